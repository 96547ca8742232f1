"""The DifficultyMonitor's heatmap: replay-buffer trajectories counted by question tier and entropy, drawn as
TensorBoard shows it (axes, tick labels, a colour bar with numbers).

`heatmap_counts` is the arithmetic (numpy); `draw_heatmap` renders it with matplotlib (the `viz` extra),
imported when called, so the monitor's other statistics need no plotting library.
"""

from __future__ import annotations

import numpy as np
import torch

from exgrpo_pl.experience.difficulty import tier_of

HEATMAP_SIZE = (5.6, 4.4)  # inches, at HEATMAP_DPI: a 560 x 440 picture, legible at TensorBoard's card size
HEATMAP_DPI = 100


def heatmap_counts(
    rates: np.ndarray, entropy: np.ndarray, num_tiers: int, entropy_bins: int
) -> tuple[np.ndarray, np.ndarray]:
    """Trajectories per (entropy bin, tier) and the entropy bins' edges.

    Args:
        rates: `[N]` correctness rate of each trajectory's question, in [0, 1].
        entropy: `[N]` mean token entropy of each trajectory.
        num_tiers: equal-width correctness-rate tiers (`tier_of`), the columns.
        entropy_bins: equal-width entropy bins between the lowest and the highest entropy, the rows; a bin
            holds its lower edge, the last one its upper edge too.

    Returns:
        `(counts, edges)`: int64 `[entropy_bins, num_tiers]` counts, row 0 the lowest entropies, and the
            `[entropy_bins + 1]` edges (one value: a bin of width 1 around it).
    """
    tiers = tier_of(torch.from_numpy(np.asarray(rates, dtype=np.float64)), num_tiers).numpy()
    low, high = float(entropy.min()), float(entropy.max())
    if high <= low:
        low, high = low - 0.5, high + 0.5
    edges = np.linspace(low, high, entropy_bins + 1)
    bins = np.clip(np.searchsorted(edges, entropy, side="right") - 1, 0, entropy_bins - 1)
    counts = np.zeros((entropy_bins, num_tiers), dtype=np.int64)
    np.add.at(counts, (bins, tiers), 1)
    return counts, edges


def draw_heatmap(counts: np.ndarray, edges: np.ndarray, title: str) -> np.ndarray:
    """`[H, W, 3]` uint8 picture of `counts` (`heatmap_counts`) with its axes, tick labels and colour bar.

    x: the tiers' correctness-rate ranges (hardest left); y: the entropy bins' edges (lowest at the bottom);
    colour: trajectories per cell, with each non-empty cell's count written in it. Raises ImportError without
    matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, tiers = counts.shape
    fig = Figure(figsize=HEATMAP_SIZE, dpi=HEATMAP_DPI)
    canvas = FigureCanvasAgg(fig)  # a figure of its own, off pyplot: no display, no global state
    ax = fig.add_subplot()
    shown = ax.imshow(
        counts,
        origin="lower",
        aspect="auto",
        cmap="viridis",
        vmin=0,
        extent=(0, tiers, 0, rows),
        interpolation="nearest",
    )
    ax.set_xticks(np.arange(tiers) + 0.5, [f"{i / tiers:.2g}-{(i + 1) / tiers:.2g}" for i in range(tiers)])
    step = max(1, rows // 5)  # about five labelled edges: more overlap at this size
    ax.set_yticks(np.arange(0, rows + 1, step), [f"{e:.3g}" for e in edges[::step]])
    ax.set_xlabel("question correctness rate (tier; hardest left)")
    ax.set_ylabel("trajectory mean token entropy")
    ax.set_title(title, fontsize=10, loc="left")
    bright = counts.max() / 2
    for (row, column), count in np.ndenumerate(counts):
        if count:
            colour = "black" if count > bright else "white"
            ax.text(column + 0.5, row + 0.5, str(count), ha="center", va="center", fontsize=7, color=colour)
    fig.colorbar(shown, ax=ax, label="trajectories per cell")
    fig.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()

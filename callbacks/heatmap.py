"""The DifficultyMonitor's heatmap: replay-buffer trajectories counted by question tier and entropy, beside
the ones replay drew, drawn as TensorBoard shows it (axes, tick labels, a colour bar with numbers) on
entropy bins and a colour scale that stay the same over the run, so that pictures of two steps compare.

`heatmap_counts` is the arithmetic (numpy); `draw_heatmap` renders it with matplotlib (the `viz` extra),
imported when called, so the monitor's other statistics need no plotting library.
"""

from __future__ import annotations

import numpy as np
import torch

from exgrpo_pl.experience.difficulty import tier_of

HEATMAP_SIZE = (8.0, 4.4)  # inches, at HEATMAP_DPI: two panels and a colour bar, 800 x 440 pixels
HEATMAP_DPI = 100


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5 and 5 times a power of ten at or above `value` (> 0): an axis end."""
    power = 10.0 ** np.floor(np.log10(value))
    return float(next(power * step for step in (1, 2, 2.5, 5, 10) if power * step >= value * (1 - 1e-12)))


def heatmap_counts(rates: np.ndarray, entropy: np.ndarray, num_tiers: int, edges: np.ndarray) -> np.ndarray:
    """Trajectories per (entropy bin, tier).

    Args:
        rates: `[N]` correctness rate of each trajectory's question, in [0, 1].
        entropy: `[N]` mean token entropy of each trajectory.
        num_tiers: equal-width correctness-rate tiers (`tier_of`), the columns.
        edges: `[B + 1]` increasing entropy edges, the rows; a bin holds its lower edge, and an entropy
            below the first edge or above the last is counted in the first or the last bin.

    Returns:
        int64 `[B, num_tiers]` counts, row 0 the lowest entropies.
    """
    tiers = tier_of(torch.from_numpy(np.asarray(rates, dtype=np.float64)), num_tiers).numpy()
    bins = len(edges) - 1
    rows = np.clip(np.searchsorted(edges, entropy, side="right") - 1, 0, bins - 1)
    counts = np.zeros((bins, num_tiers), dtype=np.int64)
    np.add.at(counts, (rows, tiers), 1)
    return counts


def draw_heatmap(
    stored: np.ndarray, replayed: np.ndarray, edges: np.ndarray, title: str, most: int
) -> np.ndarray:
    """`[H, W, 3]` uint8 picture of two count grids (`heatmap_counts`) side by side, on one logarithmic
    colour scale from 1 to `most` (an empty cell is white), with axes, tick labels and a colour bar.

    x: the tiers' correctness-rate ranges (hardest left); y: the entropy bins' edges (lowest at the bottom);
    colour: trajectories per cell, with each non-empty cell's count written in it. Left: what the buffer
    holds; right: what replay drew. Raises ImportError without matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    rows, tiers = stored.shape
    fig = Figure(figsize=HEATMAP_SIZE, dpi=HEATMAP_DPI)
    canvas = FigureCanvasAgg(fig)  # a figure of its own, off pyplot: no display, no global state
    axes = fig.subplots(1, 2, sharey=True)
    norm = LogNorm(vmin=1, vmax=max(most, 2))
    for ax, counts, name in zip(axes, (stored, replayed), ("stored", "replayed since the last picture")):
        shown = ax.imshow(
            np.ma.masked_equal(counts, 0), origin="lower", aspect="auto", cmap="viridis", norm=norm,
            extent=(0, tiers, 0, rows), interpolation="nearest",
        )  # fmt: skip
        ax.set_xticks(
            np.arange(tiers) + 0.5, [f"{i / tiers:.2g}-{(i + 1) / tiers:.2g}" for i in range(tiers)]
        )
        ax.tick_params(axis="x", labelsize=8)
        ax.set_title(f"{name}: {int(counts.sum())}", fontsize=10, loc="left")
        for (row, column), count in np.ndenumerate(counts):
            if count:
                colour = "black" if norm(count) > 0.6 else "white"
                ax.text(
                    column + 0.5, row + 0.5, str(count), ha="center", va="center", fontsize=8, color=colour
                )
    step = max(1, rows // 5)  # about five labelled edges: more overlap at this size
    axes[0].set_yticks(np.arange(0, rows + 1, step), [f"{e:.3g}" for e in edges[::step]])
    axes[0].set_ylabel("trajectory mean token entropy")
    fig.supxlabel("question correctness rate (tier; hardest left)", fontsize=10)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.colorbar(shown, ax=axes, label="trajectories per cell (log)")
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()

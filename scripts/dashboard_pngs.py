"""Dashboard "screenshots" for docs/dashboards.md, rendered headless from a run's TensorBoard event files.

    exgrpo fit --config configs/quickstart.yaml
    python scripts/dashboard_pngs.py          # latest lightning_logs/version_* -> docs/dashboards/
    python scripts/dashboard_pngs.py --run-dir lightning_logs/version_3 --out /tmp/dashboards

Writes, with matplotlib (no TensorBoard server, no display):

- scalars.png: train/reward, val/pass@1, train/entropy and replay/fraction over optimizer steps (the raw
  values faint, TensorBoard's exponential smoothing on top);
- monitor_histograms.png: the last monitor/correctness_rate, monitor/entropy and monitor/staleness
  histograms that `DifficultyMonitor` logged;
- heatmap.png: the last monitor/difficulty_entropy_heatmap image, decoded from its PNG bytes, with the axes
  and scale its description and text give.

`--run-dir` is one version_N folder or a folder of them (the highest-numbered one with event files is read).
Exits with status 1, after writing what it could, when the run lacks what a picture needs (a run without a
`DifficultyMonitor` has no histograms and no heatmap).
"""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

# The monitor's pixels per heatmap cell and of the gap and colour bar right of it: where the tiers are.
from exgrpo_pl.callbacks.monitor import HEATMAP_BAR, HEATMAP_CELL  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCALARS = (
    ("train/reward", "training reward (mean over rollouts)"),
    ("val/pass@1", "validation pass@1"),
    ("train/entropy", "mean token entropy of the trained rows"),
    ("replay/fraction", "share of trained rows that were replayed"),
)
HISTOGRAMS = (
    ("monitor/correctness_rate", "correctness rate per known question"),
    ("monitor/entropy", "entropy per buffered trajectory"),
    ("monitor/staleness", "age per buffered trajectory (steps)"),
)
HEATMAP = "monitor/difficulty_entropy_heatmap"
# DifficultyMonitor's text beside each heatmap image.
SCALE = re.compile(
    r"(?P<rows>\d+) trajectories; entropy (?P<low>\S+) \(bottom\) to (?P<high>\S+) \(top\); "
    r"the brightest cell holds (?P<max>\d+)"
)
SMOOTHING = 0.6  # TensorBoard's default
DISPLAY_BINS = 30  # equal-width bins a histogram is drawn with, as in TensorBoard


def find_run(run_dir: Path) -> Path:
    """`run_dir` if it holds event files, else its highest-numbered version_* that does."""
    if list(run_dir.glob("events.out.tfevents.*")):
        return run_dir
    versions = [
        p
        for p in run_dir.glob("version_*")
        if p.name.split("_")[-1].isdigit() and list(p.glob("events.out.tfevents.*"))
    ]
    if not versions:
        raise SystemExit(
            f"no version_* with TensorBoard event files under {run_dir}; "
            "run `exgrpo fit --config configs/quickstart.yaml` first or pass --run-dir"
        )
    return max(versions, key=lambda p: int(p.name.split("_")[-1]))


def load_events(run: Path) -> EventAccumulator:
    # 0 = keep every event: the default guidance samples histograms and keeps only a few images.
    sizes = {"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}
    events = EventAccumulator(str(run), size_guidance=sizes)
    events.Reload()
    return events


def smooth(values: np.ndarray, weight: float = SMOOTHING) -> np.ndarray:
    """TensorBoard's debiased exponential moving average."""
    out, last = np.empty(len(values)), 0.0
    for i, value in enumerate(values):
        last = last * weight + (1 - weight) * value
        out[i] = last / (1 - weight ** (i + 1))
    return out


def plot_scalars(events: EventAccumulator, path: Path, title: str, dpi: int) -> list[str]:
    available = set(events.Tags()["scalars"])
    missing = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    for ax, (tag, description) in zip(axes.flat, SCALARS):
        ax.set_title(tag, fontsize=11, loc="left")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if tag not in available:
            missing.append(tag)
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
            continue
        points = events.Scalars(tag)
        steps = np.array([p.step for p in points])
        values = np.array([p.value for p in points])
        if tag.startswith("val/"):  # a handful of evaluations: show each one
            ax.plot(steps, values, "o-", color="tab:blue", ms=4)
        else:
            ax.plot(steps, values, color="tab:orange", alpha=0.25, lw=1)
            ax.plot(steps, smooth(values), color="tab:orange", lw=1.6)
        ax.set_ylabel(description, fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return missing


def rebin(hist, bins: int = DISPLAY_BINS) -> tuple[np.ndarray, np.ndarray]:
    """(counts, edges) of a TensorBoard histogram on `bins` equal bins between its min and max.

    The stored buckets grow exponentially away from 0 (a value of 0 lands in one 1e-12 wide), so drawn as
    they are most of them would be invisible; like TensorBoard's own view, each bucket's count goes to the
    equal-width bin holding its centre (bucket i covers (limit[i-1], limit[i]], clamped to [min, max]).
    """
    limits = np.asarray(hist.bucket_limit, dtype=np.float64)
    counts = np.asarray(hist.bucket, dtype=np.float64)
    low, high = float(hist.min), float(hist.max)
    if high <= low:  # a single value: one bin around it
        return np.array([counts.sum()]), np.array([low - 0.5, high + 0.5])
    lower = np.concatenate([[low], limits[:-1]])
    centres = np.clip((np.clip(lower, low, high) + np.clip(limits, low, high)) / 2, low, high)
    edges = np.linspace(low, high, bins + 1)
    index = np.clip(np.searchsorted(edges, centres, side="right") - 1, 0, bins - 1)
    return np.bincount(index, weights=counts, minlength=bins), edges


def plot_histograms(events: EventAccumulator, path: Path, title: str, dpi: int) -> list[str]:
    available = set(events.Tags()["histograms"])
    missing = [tag for tag, _ in HISTOGRAMS if tag not in available]
    if len(missing) == len(HISTOGRAMS):
        return missing
    fig, axes = plt.subplots(1, len(HISTOGRAMS), figsize=(13, 3.8))
    for ax, (tag, description) in zip(axes, HISTOGRAMS):
        ax.set_title(tag, fontsize=11, loc="left")
        ax.grid(alpha=0.3)
        if tag not in available:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
            continue
        last = events.Histograms(tag)[-1]
        hist = last.histogram_value
        ax.stairs(*rebin(hist), fill=True, color="tab:orange", alpha=0.75)
        ax.set_xlabel(
            f"{description}\nstep {last.step}, {int(hist.num)} values, mean {hist.sum / hist.num:.3g}"
        )
        ax.set_ylabel("count")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return missing


def save_heatmap(events: EventAccumulator, path: Path, title: str, dpi: int) -> list[str]:
    """The last heatmap image as TensorBoard shows it, framed with the axes and scale that TensorBoard gives
    in the image's description and in the text of the same name."""
    if HEATMAP not in set(events.Tags()["images"]):
        return [HEATMAP]
    image = events.Images(HEATMAP)[-1]
    pixels = plt.imread(io.BytesIO(image.encoded_image_string), format="png")
    texts = f"{HEATMAP}/text_summary"  # where SummaryWriter.add_text puts the text of that name
    scale = None
    if texts in set(events.Tags()["tensors"]):
        scale = next((t for t in events.Tensors(texts) if t.step == image.step), None)
    numbers = SCALE.search(scale.tensor_proto.string_val[0].decode()) if scale is not None else None
    if numbers is None:
        print(f"heatmap.png: no scale text at step {image.step}, the axes show no numbers")
    tiers = (pixels.shape[1] - sum(HEATMAP_BAR)) // HEATMAP_CELL[1]
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    ax.imshow(pixels, interpolation="nearest")
    ax.set_xticks([(i + 0.5) * HEATMAP_CELL[1] for i in range(tiers)])
    ax.set_xticklabels([f"{i / tiers:.1f}-{(i + 1) / tiers:.1f}" for i in range(tiers)], fontsize=8)
    ax.set_xlabel("question correctness rate (tier)")
    ax.set_yticks([pixels.shape[0] - 0.5, -0.5])
    low, high, brightest = ("lowest", "highest", "most")
    if numbers:
        low, high, brightest = numbers["low"], numbers["high"], numbers["max"]
    ax.set_yticklabels([low, high])
    ax.set_ylabel("trajectory mean token entropy")
    bar = pixels.shape[1] - HEATMAP_BAR[1] / 2
    ax.text(bar, -2, brightest, ha="center", va="bottom", fontsize=9)
    ax.text(bar, pixels.shape[0] + 1, "0", ha="center", va="top", fontsize=9)
    count = f", {numbers['rows']} trajectories" if numbers else ""
    ax.set_title(f"buffer at step {image.step}{count}", fontsize=10, loc="left", pad=14)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run-dir", type=Path, default=Path("lightning_logs"), help="default: lightning_logs"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "dashboards", help="default: docs/dashboards"
    )
    parser.add_argument("--dpi", type=int, default=110)
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    if not run_dir.is_absolute() and not run_dir.exists() and (ROOT / run_dir).exists():
        run_dir = ROOT / run_dir  # called from elsewhere than the repository root
    run = find_run(run_dir)
    events = load_events(run)
    args.out.mkdir(parents=True, exist_ok=True)
    title = f"exgrpo-pl - {run.parent.name}/{run.name}"

    print(f"read {run}")
    missing: list[str] = []
    for name, render, tags in (
        ("scalars.png", lambda path: plot_scalars(events, path, title, args.dpi), SCALARS),
        ("monitor_histograms.png", lambda path: plot_histograms(events, path, title, args.dpi), HISTOGRAMS),
        ("heatmap.png", lambda path: save_heatmap(events, path, title, args.dpi), ((HEATMAP, ""),)),
    ):
        lacking = render(args.out / name)
        missing += lacking
        if len(lacking) < len(tags):
            print(f"wrote {args.out / name}")
    if missing:
        print(
            f"not in the run: {', '.join(missing)} (is a DifficultyMonitor among its callbacks?)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

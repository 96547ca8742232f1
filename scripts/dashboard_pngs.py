"""The pictures of docs/dashboards.md, drawn from a quickstart run's TensorBoard event files, headless.

    python scripts/dashboard_pngs.py                      # runs the quickstart, then draws (minutes)
    python scripts/dashboard_pngs.py --run-dir lightning_logs/exgrpo-s0 --out /tmp/dashboards

Without `--run-dir` it runs `exgrpo fit --config configs/quickstart.yaml` in a temporary directory with
ATen's portable kernels (docs/getting-started.md's quickstart sentence, which `scripts/check_quickstart.py`
holds to the current code), and draws from that run. Writes, with matplotlib (no TensorBoard server, no
display):

- scalars.png: val/pass@1, train/reward, replay/row_fraction with train/replayed_share (what replay takes
  of the batch's rows, and of the update's weight), and train/entropy over optimizer steps (the raw values
  faint, TensorBoard's exponential smoothing on top);
- monitor_histograms.png: the last monitor/correctness_rate, monitor/entropy and monitor/staleness
  histograms that `DifficultyMonitor` logged;
- heatmap.png: the last monitor/difficulty_entropy_heatmap image, as TensorBoard shows it;
- validation_curve.png: the last val/pass@1_curve image (the module's picture of the whole validation
  curve), as TensorBoard shows it;
- run.json: what the pictures were drawn from (the run's scalar and image tags, its validation curve and
  last step), which tests/scripts/test_dashboard_pngs.py holds to getting-started.md's quickstart sentence.

`--run-dir` is one run's folder or a log folder of them (the one with the newest event file is read).
Exits with status 1, after writing what it could, when the run lacks what a picture needs (a run without a
`DifficultyMonitor` has no histograms and no heatmap).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from exgrpo_pl.callbacks.monitor import HEATMAP_TAG  # noqa: E402
from exgrpo_pl.module.hparams_tab import FOLDER_SUMMARY  # noqa: E402
from exgrpo_pl.module.validation_curve import CURVE_TAG  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (tags drawn together, the y axis's label); the first tag of a panel is its title.
SCALARS = (
    (("val/pass@1",), "validation pass@1"),
    (("train/reward",), "training reward (mean over rollouts)"),
    (("replay/row_fraction", "train/replayed_share"), "replayed share: of the rows, of the update"),
    (("train/entropy",), "mean token entropy of the trained rows"),
)
COLOURS = ("tab:orange", "tab:purple")
HISTOGRAMS = (
    ("monitor/correctness_rate", "correctness rate per known question"),
    ("monitor/entropy", "entropy per buffered trajectory"),
    ("monitor/staleness", "age per buffered trajectory (steps)"),
)
SMOOTHING = 0.6  # TensorBoard's default
DISPLAY_BINS = 30  # equal-width bins a histogram is drawn with, as in TensorBoard


def find_run(run_dir: Path) -> Path:
    """`run_dir` if it holds a run's event files, else the newest of its run folders that does."""
    if run_events(run_dir):
        return run_dir
    runs = [p for p in run_dir.iterdir() if p.is_dir() and run_events(p)] if run_dir.is_dir() else []
    if not runs:
        raise SystemExit(
            f"no run folder with TensorBoard event files under {run_dir}; "
            "run `exgrpo fit --config configs/quickstart.yaml` first or pass --run-dir"
        )
    return max(runs, key=lambda p: max(f.stat().st_mtime for f in run_events(p)))


def run_events(folder: Path) -> list[Path]:
    """A run's event files in `folder` (not the log folder's HParams columns, `FOLDER_SUMMARY`)."""
    return [f for f in folder.glob("events.out.tfevents.*") if f.name != FOLDER_SUMMARY]


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
    for ax, (tags, description) in zip(axes.flat, SCALARS):
        ax.set_title(" and ".join(tags), fontsize=11, loc="left")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(description, fontsize=9)
        ax.grid(alpha=0.3)
        missing += [tag for tag in tags if tag not in available]
        if not set(tags) & available:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
            continue
        for tag, colour in zip([t for t in tags if t in available], COLOURS):
            steps, values = curve(events, tag)
            if tag.startswith("val/"):  # a handful of evaluations: show each one
                ax.plot(steps, values, "o-", color="tab:blue", ms=4)
                continue
            ax.plot(steps, values, color=colour, alpha=0.25, lw=1)
            ax.plot(steps, smooth(values), color=colour, lw=1.6, label=tag)
        if len(tags) > 1:
            ax.legend(fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return missing


def curve(events: EventAccumulator, tag: str) -> tuple[np.ndarray, np.ndarray]:
    points = events.Scalars(tag)
    return np.array([p.step for p in points]), np.array([p.value for p in points])


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


def save_image(events: EventAccumulator, tag: str, path: Path) -> list[str]:
    """The last image of `tag`, byte for byte as TensorBoard shows it (its writer drew the axes)."""
    if tag not in set(events.Tags()["images"]):
        return [tag]
    path.write_bytes(events.Images(tag)[-1].encoded_image_string)
    return []


def run_quickstart(directory: Path) -> Path:
    """Runs the quickstart in `directory` with ATen's portable kernels; its run folder."""
    config = ROOT / "configs" / "quickstart.yaml"  # `exgrpo fit`, run by this Python
    command = [sys.executable, "-m", "exgrpo_pl.cli", "fit", "--config", str(config),
               f"--trainer.default_root_dir={directory}"]  # fmt: skip
    print("running", " ".join(command), "(ATEN_CPU_CAPABILITY=default)")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    subprocess.run(command, cwd=directory, env=env, check=True)
    return directory / "lightning_logs" / "quickstart-s0"  # the config and its seed


def record(events: EventAccumulator) -> dict:
    """What the pictures were drawn from: the tags, the validation curve, the last step."""
    tags = events.Tags()
    scalars = sorted(tags["scalars"])
    steps, values = curve(events, "val/pass@1") if "val/pass@1" in scalars else ([], [])
    return {
        "command": "ATEN_CPU_CAPABILITY=default exgrpo fit --config configs/quickstart.yaml",
        "scalars": scalars,
        "histograms": sorted(tags["histograms"]),
        "images": sorted(tags["images"]),
        "val/pass@1": [[int(step), round(float(value), 6)] for step, value in zip(steps, values)],
        "last_step": max(e.step for tag in scalars for e in events.Scalars(tag)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, help="draw from this run; default: run the quickstart")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "dashboards", help="default: docs/dashboards"
    )
    parser.add_argument("--dpi", type=int, default=110)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run = find_run(args.run_dir) if args.run_dir else run_quickstart(Path(tmp))
        return draw(run, args.out, args.dpi)


def draw(run: Path, out: Path, dpi: int) -> int:
    events = load_events(run)
    out.mkdir(parents=True, exist_ok=True)
    title = "exgrpo-pl quickstart (configs/quickstart.yaml)"
    print(f"read {run}")
    missing: list[str] = []
    for name, render, tags in (
        ("scalars.png", lambda path: plot_scalars(events, path, title, dpi), SCALARS),
        ("monitor_histograms.png", lambda path: plot_histograms(events, path, title, dpi), HISTOGRAMS),
        ("heatmap.png", lambda path: save_image(events, HEATMAP_TAG, path), (HEATMAP_TAG,)),
        ("validation_curve.png", lambda path: save_image(events, CURVE_TAG, path), (CURVE_TAG,)),
    ):
        lacking = render(out / name)
        missing += lacking
        if len(lacking) < len(tags):
            print(f"wrote {out / name}")
    (out / "run.json").write_text(json.dumps(record(events), indent=1) + "\n")
    if missing:
        print(
            f"not in the run: {', '.join(missing)} (is a DifficultyMonitor among its callbacks?)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

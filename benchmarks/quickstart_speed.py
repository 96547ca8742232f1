"""The quickstart's wall time on this checkout against an earlier commit, side by side.

Runs `exgrpo fit --config configs/quickstart.yaml` (or `--config`'s file) of each tree in turn (baseline,
current, baseline, ...), each in a fresh process and a temporary folder, without progress bar or checkpoint,
and reports the median wall time of each and their ratio. The baseline is the commit's files (`git archive`)
run from source; the current tree is the installed `exgrpo_pl` (this checkout, `pip install -e .`). Both use
this environment's packages, so the ratio is the code's. The config is each tree's own file of that name: give
one whose settings both commits share, or the ratio compares different runs. Writes
benchmarks/results/quickstart_speed.json.

    # af1a4f0 made the quickstart the recommended preset on the reasoning task; its settings are today's
    # (only the class paths differ: the package's modules have moved into folders since)
    python benchmarks/quickstart_speed.py --baseline af1a4f0 --rounds 2
    python benchmarks/quickstart_speed.py --baseline HEAD --rounds 1 --steps 3   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Runs the CLI of whichever exgrpo_pl is first on the path.
CLI = "import sys; from exgrpo_pl.cli import main; main(sys.argv[1:])"


def checkout(commit: str, into: Path) -> Path:
    """The commit's files under `into`, importable from source: the wheel installs callbacks/ as
    exgrpo_pl.callbacks, which a source tree gets as a link."""
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "exgrpo_pl" / "callbacks").symlink_to(into / "callbacks", target_is_directory=True)
    return into


def quickstart_seconds(tree: Path | None, config_name: str, steps: int | None) -> float:
    """Wall time of one run of `tree`'s config `config_name` with `tree`'s source (None: the installed
    package, this checkout)."""
    config = (tree or ROOT) / config_name
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree is not None else dict(os.environ)
    with tempfile.TemporaryDirectory() as run_dir:
        args = ["fit", "--config", str(config), f"--trainer.default_root_dir={run_dir}",
                "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]  # fmt: skip
        if steps is not None:
            args.append(f"--trainer.max_steps={steps}")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", CLI, *args], cwd=run_dir, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="a commit, e.g. e09aa08 or HEAD~5")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree (default 3)")
    parser.add_argument("--config", default="configs/quickstart.yaml", help="a config both trees have")
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default: the config's)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", args.baseline], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    seconds: dict[str, list[float]] = {f"baseline {commit}": [], "this checkout": []}
    with tempfile.TemporaryDirectory() as tmp:
        baseline = checkout(commit, Path(tmp))
        for round_ in range(args.rounds):
            for name, tree in zip(seconds, (baseline, None)):
                seconds[name].append(quickstart_seconds(tree, args.config, args.steps))
                print(f"round {round_ + 1}: {name:20s} {seconds[name][-1]:6.1f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    base, current = medians.values()
    print(f"median: baseline {base:.1f} s, this checkout {current:.1f} s, ratio {current / base:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "config": args.config,
        "steps": args.steps,
        "seconds": seconds,
        "median": medians,
        "ratio": current / base,
    }
    (RESULTS / "quickstart_speed.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

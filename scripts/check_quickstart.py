"""Runs the README's quickstart command and checks that it prints the numbers the README says it prints.

The README states the validation pass@1 before and after the quickstart (`went from **A to B**`) and the
best value on the way (`best C at step S`). This runs `exgrpo fit --config configs/quickstart.yaml` in a
temporary directory, reads the run's TensorBoard events, prints what it measured beside what the README
says, and exits 1 if they differ (in the third decimal). Seeded and deterministic on one machine; another
CPU or torch build can sample differently, which is why this is a script to run, not a test.

    python scripts/check_quickstart.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).parents[1]
CLAIM = re.compile(
    r"went from \*\*(?P<start>[0-9.]+) to (?P<final>[0-9.]+)\*\*.*?"
    r"best (?P<best>[0-9.]+) at step (?P<step>\d+)",
    re.S,
)


def readme_claim() -> dict[str, float]:
    match = CLAIM.search((ROOT / "README.md").read_text())
    if match is None:
        raise SystemExit("README.md has no 'went from **A to B** ... best C at step S' sentence")
    return {key: float(value) for key, value in match.groupdict().items()}


def measure() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        command = ["exgrpo", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
                   f"--trainer.default_root_dir={tmp}"]  # fmt: skip
        subprocess.run(command, cwd=tmp, check=True)
        (run,) = Path(tmp).glob("lightning_logs/version_*")
        events = EventAccumulator(str(run))
        events.Reload()
        curve = [(e.step, e.value) for e in events.Scalars("val/pass@1")]
    step, best = max(curve[1:], key=lambda point: point[1])
    return {"start": curve[0][1], "final": curve[-1][1], "best": best, "step": float(step)}


def main() -> None:
    claim, measured = readme_claim(), measure()
    differ = [key for key in claim if round(claim[key], 3) != round(measured[key], 3)]
    for key in claim:
        mark = "  <- differs" if key in differ else ""
        print(f"{key:6s} README {claim[key]:g}  measured {measured[key]:.3f}{mark}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

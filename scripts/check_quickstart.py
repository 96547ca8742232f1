"""Runs the README's quickstart command and checks that it prints the numbers the docs say it prints.

The validation pass@1 before and after the quickstart (`went from **A to B**`) and the best value on the way
(`best C at step S`) are stated twice: in the README with the kernels ATen picks for this project's machine
(AVX-512), and in docs/getting-started.md with ATen's portable CPU kernels (ATEN_CPU_CAPABILITY=default).
Both were measured on this project's machine: the portable kernels pin ATen's rounding but not MKL's, whose
code path depends on the CPU (benchmarks/cpu_kernels.py lists what changes the losses on a machine), so
another machine may print other numbers. This runs `exgrpo fit --config configs/quickstart.yaml` in a
temporary directory with the portable kernels (with `--native`: the CPU's own, checked against the README),
reads the run's TensorBoard events, prints what it measured beside what the page says, and exits 1 if they
differ (in the third decimal). A run of minutes, so a script to run, not a test.

    python scripts/check_quickstart.py              # getting-started.md's sentence: the portable kernels
    python scripts/check_quickstart.py --native     # the README's: this project's machine (AVX-512 kernels)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).parents[1]
CLAIM = re.compile(
    r"went\s+from\s+\*\*(?P<start>[0-9.]+) to (?P<final>[0-9.]+)\*\*.*?"
    r"best\s+(?P<best>[0-9.]+)\s+at\s+step\s+(?P<step>\d+)",
    re.S,
)


# Where each sentence is: the portable kernels' (native False), this project's machine's (native True).
PAGES = {False: ROOT / "docs" / "getting-started.md", True: ROOT / "README.md"}


def claim(native: bool) -> dict[str, float]:
    """The portable kernels' sentence (docs/getting-started.md), or with `native` this machine's (README)."""
    page = PAGES[native]
    matches = list(CLAIM.finditer(page.read_text()))
    if len(matches) != 1:
        raise SystemExit(f"{page.name} should have one 'went from **A to B** ... best C at step S' sentence")
    return {key: float(value) for key, value in matches[0].groupdict().items()}


def measure(native: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        command = ["exgrpo", "fit", "--config", str(ROOT / "configs" / "quickstart.yaml"),
                   f"--trainer.default_root_dir={tmp}"]  # fmt: skip
        env = dict(os.environ) if native else {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
        subprocess.run(command, cwd=tmp, env=env, check=True)
        (run,) = Path(tmp).glob("lightning_logs/quickstart-s0")  # the config and its seed
        events = EventAccumulator(str(run))
        events.Reload()
        curve = [(e.step, e.value) for e in events.Scalars("val/pass@1")]
    step, best = max(curve[1:], key=lambda point: point[1])
    return {"start": curve[0][1], "final": curve[-1][1], "best": best, "step": float(step)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--native", action="store_true", help="the CPU's own kernels: this machine's sentence"
    )
    native = parser.parse_args().native
    said, measured = claim(native), measure(native)
    differ = [key for key in said if round(said[key], 3) != round(measured[key], 3)]
    for key in said:
        mark = "  <- differs" if key in differ else ""
        print(f"{key:6s} {PAGES[native].name} {said[key]:g}  measured {measured[key]:.3f}{mark}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

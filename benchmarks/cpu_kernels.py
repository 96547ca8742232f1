"""Why the seeded quickstart prints other numbers on another CPU, and what pinning ATen's kernels costs.

Runs the first steps of `exgrpo fit --config configs/quickstart.yaml` (no validation, a loss logged every
step) under settings that each change one thing a machine can differ in: the thread count, MKL's instruction
set (MKL_ENABLE_INSTRUCTIONS) and the vectorised kernels ATen picks by the CPU's instruction set
(ATEN_CPU_CAPABILITY: "default" is ATen's portable build). It prints which settings give the same losses bit
for bit on the machine it runs on, and the wall time of the portable kernels against the machine's own,
alternating rounds side by side. Writes benchmarks/results/cpu_kernels.json. What it finds holds for that
machine only: settings that change nothing on one CPU (the thread count, MKL's instruction set) changed the
losses on another, and MKL's own code path (MKL_CBWR) is not pinned by any of them.

    python benchmarks/cpu_kernels.py                    # 20 steps, 2 rounds of the timed pair
    python benchmarks/cpu_kernels.py --steps 1 --rounds 1 --settings "one thread"   # a smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CLI = "import sys; from exgrpo_pl.cli import main; main(sys.argv[1:])"
SETTINGS = {
    "this CPU's kernels": {},
    "one thread": {"OMP_NUM_THREADS": "1"},
    "MKL limited to AVX2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "ATen AVX2 kernels": {"ATEN_CPU_CAPABILITY": "avx2"},
    "ATen portable kernels": {"ATEN_CPU_CAPABILITY": "default"},
    "ATen portable kernels, MKL limited to AVX2": {
        "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2"
    },
    # MKL's conditional numerical reproducibility: its SSE2-era path, whatever the CPU.
    "ATen portable kernels, MKL_CBWR=COMPATIBLE": {
        "ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"
    },
}  # fmt: skip
TIMED = ("this CPU's kernels", "ATen portable kernels")


def quickstart_losses(env: dict[str, str], steps: int) -> tuple[list[float], float]:
    """The training losses of the quickstart's first `steps` steps under `env`, and the run's wall time."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = ["fit", "--config", str(ROOT / "configs" / "quickstart.yaml"), f"--trainer.max_steps={steps}",
                "--trainer.log_every_n_steps=1", "--model.validate_at_start=false",
                "--trainer.limit_val_batches=0", "--trainer.enable_checkpointing=false",
                "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run_dir}"]  # fmt: skip
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", CLI, *args], cwd=run_dir, env={**os.environ, **env}, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        seconds = time.perf_counter() - start
        (run,) = Path(run_dir).glob("lightning_logs/quickstart-s0")  # the config and its seed
        events = EventAccumulator(str(run))
        events.Reload()
        return [e.value for e in events.Scalars("train/loss")], seconds


def fingerprint(losses: list[float]) -> str:
    return hashlib.sha256(json.dumps(losses).encode()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each timed setting, alternating")
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help=f"default: all; the timed pair always runs ({' and '.join(TIMED)})")  # fmt: skip
    args = parser.parse_args()
    runs: dict[str, dict] = {}
    for name in dict.fromkeys([*args.settings, *TIMED]):
        env = SETTINGS[name]
        losses, seconds = quickstart_losses(env, args.steps)
        runs[name] = {
            "env": env,
            "losses": fingerprint(losses),
            "final_loss": losses[-1],
            "seconds": [seconds],
        }
        print(f"{name:45s} losses {runs[name]['losses']}  {seconds:6.1f} s", flush=True)
    for _ in range(args.rounds - 1):
        for name in TIMED:
            runs[name]["seconds"].append(quickstart_losses(SETTINGS[name], args.steps)[1])
    groups: dict[str, list[str]] = {}
    for name, run in runs.items():
        groups.setdefault(run["losses"], []).append(name)
    native, portable = (statistics.median(runs[name]["seconds"]) for name in TIMED)
    ratio = portable / native
    result = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "steps": args.steps,
        "runs": runs,
        "same_losses": list(groups.values()),
        "portable_over_native": ratio,
    }
    print(f"ATen picks {result['cpu_capability']} kernels here; settings with the same losses:")
    for names in groups.values():
        print("  " + " = ".join(names))
    print(f"portable kernels' wall time / this CPU's: {ratio:.2f}x ({portable:.1f} vs {native:.1f} s)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_kernels.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The budget of configs/quickstart_reasoning.yaml on one CPU thread: seconds per training step for several
batch sizes (generation, reward, forward/backward: the module's timing metrics) and per validation pass,
then, with --run, the config end to end: CPU seconds, val pass@1 from start to end, and how much of the
training pool the run drew.

    python benchmarks/reasoning_budget.py                  # step times at batch sizes 8 16 32, 12 steps each
    python benchmarks/reasoning_budget.py --run            # the same, then the whole config (about 4 minutes)
    python benchmarks/reasoning_budget.py --batch-sizes 2 --steps 2 --skip 1 --run --run-steps 5  # tiny

The first steps of each measurement (allocator warm-up) are left out of the means. Not a timed test: a
measurement to read. On a shared machine read the CPU columns: a one-thread process's CPU seconds are its
wall seconds on an idle core.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule

CONFIG = Path(__file__).parents[1] / "configs" / "quickstart_reasoning.yaml"
PHASES = ("timing/generation", "timing/reward", "timing/forward_backward")


class StepTimes(Callback):
    """Keeps each training step's wall and CPU seconds and the module's per-phase seconds."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = {k: pl_module.last_step_metrics.get(k, 0.0) for k in PHASES}
        wall, cpu = time.perf_counter() - self.started[0], time.process_time() - self.started[1]
        self.steps.append({"step": wall, "cpu": cpu, **metrics})


def step_times(batch_size: int, steps: int, skip: int, workdir: str) -> tuple[dict[str, float], float, float]:
    """Mean seconds per phase over the steps after `skip`, one validation pass's CPU seconds, and the mean
    completion tokens per rollout."""
    args = [
        "--config", str(CONFIG), f"--data.batch_size={batch_size}", f"--trainer.max_steps={steps + skip}",
        "--trainer.val_check_interval=null", "--trainer.check_val_every_n_epoch=1000",
        "--model.validate_at_start=false", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false", "--trainer.logger=false",
        f"--trainer.default_root_dir={workdir}",
    ]  # fmt: skip
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    times = StepTimes()
    cli.trainer.callbacks.append(times)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    kept = times.steps[skip:]
    means = {key: statistics.mean(s[key] for s in kept) for key in kept[0]}
    tokens = cli.model.generated_tokens / (len(times.steps) * batch_size * cli.model.num_generations)
    started = time.process_time()
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return means, time.process_time() - started, tokens


def full_run(workdir: str, steps: int | None = None) -> None:
    """Fits the config (for `steps` steps if given, else as it is) and prints its cost, its val pass@1 curve
    and its use of the pool."""
    wall, cpu = time.perf_counter(), time.process_time()
    args = ["--config", str(CONFIG), "--trainer.enable_progress_bar=false"]
    args.append(f"--trainer.default_root_dir={workdir}")
    if steps is not None:
        args.append(f"--trainer.max_steps={steps}")
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    curve = [(e.step, e.value) for e in events.Scalars("val/pass@1")]
    replayed = int(events.Scalars("replay/replayed_steps")[-1].value)
    steps, batch_size = cli.trainer.global_step, cli.datamodule.hparams.batch_size
    pool = len(cli.datamodule.train_rows)
    drawn, fresh = steps * batch_size, (steps - replayed) * batch_size
    print(f"\nconfigs/quickstart_reasoning.yaml: {steps} steps, {cpu:.0f} s CPU ({wall:.0f} s wall)")
    print("val pass@1 at step: " + ", ".join(f"{step}: {value:.3f}" for step, value in curve))
    print(
        f"training pool {pool} questions: drawn {drawn} ({drawn / pool:.2f} of it), rolled out fresh {fresh} "
        f"({fresh / pool:.2f}; {replayed} steps replayed experience instead)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--run", action="store_true", help="then fit the whole config")
    parser.add_argument("--run-steps", type=int, help="with --run: this many steps, not the config's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as workdir:
        rows = [(b, *step_times(b, args.steps, args.skip, f"{workdir}/{b}")) for b in args.batch_sizes]
        print(f"\none thread, {args.steps} steps after {args.skip}; seconds (wall unless CPU)")
        print("batch  step CPU  step wall  generate  reward  fwd+bwd  tokens/rollout  validation CPU")
        for batch_size, m, validation, tokens in rows:
            phases = " ".join(f"{m[k]:{w}.3f}" for k, w in zip(PHASES, (9, 7, 8)))
            start = f"{batch_size:5d} {m['cpu']:9.3f} {m['step']:10.3f}"
            print(f"{start} {phases} {tokens:15.1f} {validation:15.2f}")
        if args.run:
            full_run(f"{workdir}/run", args.run_steps)


if __name__ == "__main__":
    main()

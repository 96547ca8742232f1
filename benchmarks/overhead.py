"""Replay bookkeeping as a share of step time: plain GRPO, ExGRPO mix and ExGRPO swap on the same config.

Runs configs/grpo_baseline.yaml as is and with a ReplayCallback: in mix mode (the paper's strategy,
rescoring entropy under the current policy), in mix mode with at most 4 stored trajectories per question,
and in swap mode; replay is on from the first step, and the variants alternate in rounds so that machine
noise hits them alike. Bookkeeping = buffer add + sampling + entropy rescoring (the callback times each);
importance weights are computed inside the loss and are part of forward/backward. Reports each variant's
time per step, the bookkeeping share (target <= 1%), and swap mode's saving from skipped generation.
"GRPO log every step" is GRPO with `log_every_n_steps=1` (the configs log every 5): the cost of building and
logging the step metrics. Writes benchmarks/results/overhead.png.

    python benchmarks/overhead.py --quick      # 3 rounds of 40 steps
    python benchmarks/overhead.py              # 5 rounds of 100 steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from lightning.pytorch import Callback

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
from exgrpo_pl.module import ExGRPOModule

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BOOKKEEPING = ("timing/replay_add", "timing/replay_sample", "timing/replay_rescore")
LOG_EVERY_STEP = "GRPO log every step"


def replay_callback(variant: str) -> ReplayCallback:
    mode = variant.split()[1]
    if mode == "mix":
        # "capped": at most 4 stored trajectories per question, which bounds the entropy rescoring.
        cap = 4 if variant.endswith("capped") else None
        bucketer = DifficultyBucketer(window_size=8)
        buffer = TrajectoryBuffer(keep="correct_of_partial", bucketer=bucketer, max_per_question=cap)
        replay = SelectiveReplay("gaussian_lowest_entropy", replay_probability=1.0)
    else:
        buffer = TrajectoryBuffer()
        replay = SelectiveReplay("entropy_guided", replay_probability=0.3)
    return ReplayCallback(buffer=buffer, replay=replay, mode=mode, min_buffer_size=8)


class StepClock(Callback):
    """Wall time per step, from one batch start to the next, and each step's bookkeeping and generation
    seconds, after `warmup` steps. It must be the first callback: its batch start then precedes the
    ReplayCallback's sampling, and the interval holds every hook of the step, the buffer add included."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps: list[float] = []
        self.bookkeeping: list[float] = []
        self.generation: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter()
        if trainer.global_step > self.warmup:  # the step that just ended is past warm-up
            self.steps.append(now - self._started)
            # The previous step's figures, read from the objects before the ReplayCallback resets them (the
            # logged metrics are written every `log_every_n_steps` only).
            replay = [c for c in trainer.callbacks if isinstance(c, ReplayCallback)]
            timings = replay[0].last_timings if replay else {}
            self.bookkeeping.append(sum(timings.get(key, 0.0) for key in BOOKKEEPING))
            self.generation.append(pl_module.last_step_metrics["timing/generation"])
        self._started = now


def run(variant: str, steps: int, workdir: Path) -> StepClock:
    args = [
        "--config", str(ROOT / "configs" / "grpo_baseline.yaml"), f"--trainer.max_steps={steps}",
        "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
        "--trainer.logger=false", "--trainer.limit_val_batches=0", "--model.validate_at_start=false",
        f"--trainer.default_root_dir={workdir}",
    ]  # fmt: skip
    if variant == LOG_EVERY_STEP:  # what building and logging the step metrics on every step would cost
        args.append("--trainer.log_every_n_steps=1")
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    if variant.startswith("ExGRPO"):
        cli.trainer.callbacks.append(replay_callback(variant))
    clock = StepClock(warmup=5)
    cli.trainer.callbacks.insert(0, clock)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return clock


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, help="override the rounds (quick 3, full 5)")
    parser.add_argument("--steps", type=int, help="override the steps per run, > 5 (quick 40, full 100)")
    args = parser.parse_args()
    rounds, steps = (3, 40) if args.quick else (5, 100)
    rounds, steps = args.rounds or rounds, args.steps or steps
    variants = ("GRPO", LOG_EVERY_STEP, "ExGRPO mix", "ExGRPO mix capped", "ExGRPO swap")
    clocks: dict[str, list[StepClock]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for variant in variants:  # A, B, C, A, B, C, ...
                clocks[variant].append(run(variant, steps, Path(tmp) / f"{variant}-{r}"))

    result = {}
    for variant, runs in clocks.items():
        step = [statistics.mean(c.steps) for c in runs]
        share = [sum(c.bookkeeping) / sum(c.steps) for c in runs]
        generation = [statistics.mean(c.generation) for c in runs]
        result[variant] = {"step_s": step, "bookkeeping_share": share, "generation_s": generation}
    base = statistics.mean(result["GRPO"]["step_s"])
    print(f"\n{rounds} rounds x {steps} steps per variant, configs/grpo_baseline.yaml (mean over rounds)")
    print(f"{'variant':20s} {'s/step':>8s} {'vs GRPO':>8s} {'bookkeeping':>12s} {'generation s':>13s}")
    for variant, r in result.items():
        step, share = statistics.mean(r["step_s"]), statistics.mean(r["bookkeeping_share"])
        generation = statistics.mean(r["generation_s"])
        print(f"{variant:20s} {step:8.3f} {step / base:8.2f}x {100 * share:11.2f}% {generation:13.3f}")
    swap, grpo = result["ExGRPO swap"], result["GRPO"]
    saving = 1 - statistics.mean(swap["generation_s"]) / statistics.mean(grpo["generation_s"])
    print(
        f"swap mode generates {100 * saving:.0f}% less per step on average (replayed steps generate nothing)"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"overhead{suffix}.json").write_text(json.dumps(result, indent=1))
    _plot(result, RESULTS / f"overhead{suffix}.png")


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result)
    steps = [statistics.mean(result[n]["step_s"]) for n in names]
    book = [s * statistics.mean(result[n]["bookkeeping_share"]) for s, n in zip(steps, names)]
    gen = [statistics.mean(result[n]["generation_s"]) for n in names]
    rest = [s - b - g for s, b, g in zip(steps, book, gen)]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.barh(names, gen, label="generation")
    ax.barh(names, rest, left=gen, label="forward/backward and the rest")
    ax.barh(names, book, left=[g + r for g, r in zip(gen, rest)], label="replay bookkeeping")
    ax.set_xlabel("seconds per step")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)  # below, off the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

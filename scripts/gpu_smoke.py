"""GPU smoke test: a tiny policy trained a few ExGRPO steps in bf16, plain and under DeepSpeed ZeRO-2/3.

`plain` trains float32 weights with bf16 autocast (`bf16-mixed`: without DeepSpeed nothing keeps fp32 master
weights of bf16 ones, `exgrpo_pl.module.strategies.check_strategy`); the DeepSpeed variants train bf16 weights
(`bf16-true`, DeepSpeed's fp32 master weights). Each variant runs in its own process (a clean CUDA context,
process group and peak-memory counter) and prints one line: mean step time, tokens/s (prompt + completion
tokens trained on) and peak GPU memory (`torch.cuda.max_memory_allocated`); its result file also has the
mean seconds per phase of a step (`timing_s`: generation, reward, replay sampling and rescoring, and the
update's forwards, backwards and optimizer step). `zero3` ends by saving a checkpoint (a directory,
DeepSpeed's shards); `resume` restores it, checks the step and the replay buffer came back, and trains on.

    bash scripts/gpu_smoke.sh                                   # every variant, then a table
    python scripts/gpu_smoke.py --variant zero2 --workdir /tmp/smoke
    python scripts/gpu_smoke.py --summary --workdir /tmp/smoke

The policy is `embedded:tiny-arith` (shipped in the package: nothing is downloaded) on the synthetic
arithmetic task, with the paper's replay (mix mode, gaussian_lowest_entropy, correct_of_partial) switched
on from the first step so that replay, rescoring and the buffer's checkpoint all run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.module.strategies import check_strategy, needs_synced_generation

VARIANTS = ("plain", "zero2", "zero3", "resume")
STRATEGIES = {
    "plain": lambda: "auto",
    "zero2": lambda: DeepSpeedStrategy(stage=2),
    "zero3": lambda: DeepSpeedStrategy(stage=3),
    "resume": lambda: DeepSpeedStrategy(stage=3),  # resumes the zero3 variant's checkpoint
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(variant: str, args: argparse.Namespace):
    """The trainer, module, datamodule and callbacks of one variant."""
    torch.manual_seed(0)
    module = ExGRPOModule(
        model_name_or_path=args.model,
        num_generations=8,
        max_completion_length=args.max_completion_length,
        learning_rate=1e-4,
        loss_type="dapo",
        scale_rewards="none",
        entropy_coef=0.001,
        max_grad_norm=1.0,
        micro_batch_size=args.micro_batch_size,
        dtype="float32" if variant == "plain" else "bfloat16",
        attn_implementation="sdpa",
    )
    datamodule = PromptDataModule(
        synthetic=ArithmeticTask(num_questions=2000, seed=0), val_fraction=0.0, batch_size=args.batch_size
    )
    replay = ReplayCallback(
        buffer=TrajectoryBuffer(keep="correct_of_partial", bucketer=DifficultyBucketer(window_size=8)),
        replay=SelectiveReplay(strategy="gaussian_lowest_entropy", replay_probability=1.0),
        mode="mix",
        mix_fraction=0.5,
        min_buffer_size=8,
    )
    strategy = STRATEGIES[variant]()
    meter = Meter(warmup=1)
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        strategy=strategy,
        precision="bf16-mixed" if variant == "plain" else "bf16-true",
        max_steps=2 * args.steps if variant == "resume" else args.steps,
        max_epochs=100,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=args.workdir,
        callbacks=[replay, meter],
    )
    return trainer, module, datamodule, replay, meter


class Meter(Callback):
    """Times training steps after `warmup` steps and counts the tokens they trained on."""

    def __init__(self, warmup: int = 1) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.tokens = 0
        self.generated = 0
        self.start_step: int | None = None
        self.buffer_at_start: int | None = None
        self._started = 0.0
        self._counts = (0, 0)
        self._seen = 0
        self.phases: dict[str, float] = {}  # seconds per phase ("timing/*"), summed over the timed steps

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        self.buffer_at_start = len(replay.buffer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _sync()
        self._started = time.perf_counter()
        self._counts = (pl_module.num_tokens, pl_module.generated_tokens)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        _sync()
        self._seen += 1
        if self._seen <= self.warmup:
            return
        self.times.append(time.perf_counter() - self._started)
        self.tokens += pl_module.num_tokens - self._counts[0]
        self.generated += pl_module.generated_tokens - self._counts[1]
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        for name, seconds in {**pl_module.last_step_metrics, **replay.last_timings}.items():
            if name.startswith("timing/"):
                self.phases[name] = self.phases.get(name, 0.0) + seconds


def run(variant: str, args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer, module, datamodule, replay, meter = build(variant, args)
    check_strategy(trainer, module, datamodule)
    checkpoint = workdir / "zero3.ckpt"
    saved = workdir / "zero3.json"
    started = time.perf_counter()
    if variant == "resume":
        if not checkpoint.exists():
            raise RuntimeError(f"no ZeRO-3 checkpoint at {checkpoint}: run --variant zero3 first")
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(checkpoint))
        expected = json.loads(saved.read_text())
        if meter.start_step != expected["global_step"]:
            raise RuntimeError(f"resumed at step {meter.start_step}, saved at {expected['global_step']}")
        if meter.buffer_at_start != expected["buffer_size"]:
            raise RuntimeError(
                f"replay buffer came back with {meter.buffer_at_start} trajectories, saved with "
                f"{expected['buffer_size']}"
            )
    else:
        trainer.fit(module, datamodule=datamodule)
    wall = time.perf_counter() - started
    if trainer.global_step != trainer.max_steps:
        raise RuntimeError(f"stopped at step {trainer.global_step} of {trainer.max_steps}")
    if variant == "zero3":
        trainer.save_checkpoint(str(checkpoint))
        if isinstance(trainer.strategy, DeepSpeedStrategy) and not checkpoint.is_dir():
            raise RuntimeError(f"the ZeRO-3 checkpoint {checkpoint} is not a directory")
        saved.write_text(json.dumps({"global_step": trainer.global_step, "buffer_size": len(replay.buffer)}))
    timed = sum(meter.times)
    result = {
        "variant": variant,
        "steps": trainer.global_step - (meter.start_step or 0),
        "step_time_s": timed / max(len(meter.times), 1),
        "timing_s": {
            name[len("timing/") :]: total / max(len(meter.times), 1) for name, total in meter.phases.items()
        },
        "tokens_per_s": meter.tokens / timed if timed else 0.0,
        "generated_tokens_per_s": meter.generated / timed if timed else 0.0,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "wall_s": wall,
        "buffer_size": len(replay.buffer),
        "replayed_steps": replay.replayed_steps,
        "synced_generation": needs_synced_generation(trainer),
        "gradient_clipping": (getattr(trainer.strategy, "config", None) or {}).get("gradient_clipping"),
    }
    if variant == "resume":
        result["resumed_from_step"] = meter.start_step
    return result


def _line(result: dict) -> str:
    return (
        f"{result['variant']:<7} steps={result['steps']:<3} "
        f"step_time={result['step_time_s'] * 1000:8.1f} ms  "
        f"tokens/s={result['tokens_per_s']:10.0f}  peak_mem={result['peak_memory_gib']:6.2f} GiB  "
        f"buffer={result['buffer_size']:<5} replayed_steps={result['replayed_steps']}"
    )


def summary(workdir: Path) -> int:
    """Print the table of every variant that reported; 1 when one is missing."""
    missing = 0
    print(f"\n{'variant':<7} results (tokens/s: prompt + completion tokens trained on, after 1 warm-up step)")
    for variant in VARIANTS:
        path = workdir / f"{variant}.result.json"
        if path.is_file():
            print(_line(json.loads(path.read_text())))
        else:
            print(f"{variant:<7} FAILED (no result)")
            missing += 1
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--summary", action="store_true", help="print the table of the variants' results")
    parser.add_argument("--workdir", required=True, help="where checkpoints and results go")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (resume: as many again)")
    parser.add_argument("--model", default="embedded:tiny-arith")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per step (x 8 rollouts)")
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument(
        "--accelerator", default="gpu", help="cpu only to try the plumbing of the plain variant"
    )
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.summary:
        return summary(workdir)
    if args.variant is None:
        parser.error("--variant or --summary is required")
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device", file=sys.stderr)
        return 2
    result = run(args.variant, args)
    (workdir / f"{args.variant}.result.json").write_text(json.dumps(result, indent=2))
    print("SMOKE " + _line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""exgrpo-pl's GRPO step against TRL's GRPOTrainer at equal work, on the CPU, side by side.

Same tiny model (embedded:tiny-arith), task, K = 8, 16 prompts (128 completions) per step, 6-token
completions, loss_type dapo, scale_rewards group, no KL, no gradient checkpointing, one update per
generation. Each (variant, round) runs in its own process, alternating TRL, ours, TRL, ours, ..., and
reports the mean time per step after warm-up and the process's peak resident memory. Target: ours <= 0.8x
TRL's time per step. Needs TRL (`pip install trl`), which is not a dependency of the package.
Writes benchmarks/results/vs_trl.png.

    python benchmarks/vs_trl.py --quick        # 2 rounds of 30 steps
    python benchmarks/vs_trl.py                # 4 rounds of 60 steps
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL, K, PROMPTS, COMPLETION, LR, WARMUP = "embedded:tiny-arith", 8, 16, 6, 5e-4, 5


def run_ours(steps: int, workdir: str) -> list[float]:
    from lightning.pytorch import Callback, Trainer

    from exgrpo_pl.data import ArithmeticTask, PromptDataModule
    from exgrpo_pl.module import ExGRPOModule

    class Clock(Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, *args):
            self.started = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self.started)

    clock = Clock()
    module = ExGRPOModule(MODEL, num_generations=K, max_completion_length=COMPLETION, learning_rate=LR)
    data = PromptDataModule(synthetic=ArithmeticTask(2000, seed=0), batch_size=PROMPTS)
    trainer = Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[clock],
        default_root_dir=workdir,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return clock.times


def run_trl(steps: int, workdir: str) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from exgrpo_pl.data import ArithmeticTask
    from exgrpo_pl.models import load_policy, load_tokenizer, resolve_model_path
    from exgrpo_pl.rewards import ArithmeticReward

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *args, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.started)

    train_rows, _ = ArithmeticTask(2000, seed=0).split(0.1)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])
    config = GRPOConfig(
        output_dir=workdir, max_steps=steps, per_device_train_batch_size=PROMPTS * K, num_generations=K,
        max_completion_length=COMPLETION, learning_rate=LR, lr_scheduler_type="constant", loss_type="dapo",
        scale_rewards="group", beta=0.0, gradient_checkpointing=False, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1000, max_grad_norm=1.0, disable_tqdm=True,
    )  # fmt: skip
    clock = Clock()
    trainer = GRPOTrainer(
        model=load_policy(MODEL), reward_funcs=[ArithmeticReward()], args=config, train_dataset=dataset,
        processing_class=load_tokenizer(resolve_model_path(MODEL)), callbacks=[clock],
    )  # fmt: skip
    trainer.train()
    return clock.times


def worker(variant: str, steps: int) -> None:
    """One run in this process; prints its step times and peak memory as JSON on the last line."""
    import torch

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as workdir:
        times = (run_trl if variant == "TRL" else run_ours)(steps, workdir)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": statistics.mean(times[WARMUP:]), "peak_bytes": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=["TRL", "exgrpo-pl"], help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    rounds, steps = (2, 30) if args.quick else (4, 60)
    if args.worker:
        worker(args.worker, args.steps)
        return
    results: dict[str, list[dict]] = {"TRL": [], "exgrpo-pl": []}
    for _ in range(rounds):
        for variant in results:  # A, B, A, B: drift on the machine hits both alike
            out = subprocess.run(
                [sys.executable, __file__, "--worker", variant, "--steps", str(steps)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))

    trl_step = statistics.mean(r["step_s"] for r in results["TRL"])
    ours_step = statistics.mean(r["step_s"] for r in results["exgrpo-pl"])
    trl_peak = statistics.mean(r["peak_bytes"] for r in results["TRL"])
    ours_peak = statistics.mean(r["peak_bytes"] for r in results["exgrpo-pl"])
    print(
        f"\n{rounds} rounds x {steps} steps, {PROMPTS} prompts x K={K}, {COMPLETION}-token completions, CPU"
    )
    print(f"{'':12s} {'s/step':>8s} {'peak RSS MiB':>13s}")
    for name, step, peak in (("TRL", trl_step, trl_peak), ("exgrpo-pl", ours_step, ours_peak)):
        print(f"{name:12s} {step:8.3f} {peak / 2**20:13.0f}")
    print(f"time per step ratio (ours / TRL): {ours_step / trl_step:.2f}x (target <= 0.8x)")
    print(f"peak memory ratio (ours / TRL):   {ours_peak / trl_peak:.2f}x")
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    (RESULTS / f"vs_trl{suffix}.json").write_text(json.dumps(results, indent=1))
    _plot(results, RESULTS / f"vs_trl{suffix}.png")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(7, 3))
    names = list(results)
    axes[0].bar(names, [statistics.mean(r["step_s"] for r in results[n]) for n in names], color=["C1", "C0"])
    axes[0].set_ylabel("seconds per step")
    axes[1].bar(names, [statistics.mean(r["peak_bytes"] for r in results[n]) / 2**20 for n in names],
                color=["C1", "C0"])  # fmt: skip
    axes[1].set_ylabel("peak RSS (MiB)")
    fig.suptitle("GRPO step on the CPU, equal work")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

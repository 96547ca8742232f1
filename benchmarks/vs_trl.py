"""exgrpo-pl's GRPO step against TRL's GRPOTrainer at equal work, on the CPU, side by side.

Same tiny model (embedded:tiny-arith), task, K = 8, 16 prompts (128 completions) per step, at most 6-token
completions (both stop at EOS), loss_type dapo, scale_rewards group, no KL, no gradient checkpointing, one
update per generation, float32 on both sides (GRPOConfig defaults to bf16 autocast, which a CPU without
bf16 matmul units runs several times slower; --trl-bf16 measures TRL with it). Per step each side does one
`generate` (KV cache) and one forward and backward over the 128 rows; neither computes old or reference
log-probs. Each (variant, round) runs in its own process, alternating TRL, ours, TRL, ours, ..., and
reports the mean time per step after warm-up and the process's peak resident memory. Target: ours <= 0.8x
TRL's time per step. Needs TRL (`pip install trl`), which is not a dependency of the package.
Writes benchmarks/results/vs_trl.png.

    python benchmarks/vs_trl.py --quick        # 2 rounds of 30 steps
    python benchmarks/vs_trl.py                # 4 rounds of 60 steps
    python benchmarks/vs_trl.py --profile      # where each side's step time goes: 8 steps under cProfile
    python benchmarks/vs_trl.py --rounds 1 --steps 7   # tiny: a smoke run

On a busy machine prefix --profile with OMP_NUM_THREADS=1: two threads per process on two busy cores spend
most of their wall time in OpenMP spin-waits, which swamps the profile.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL, K, PROMPTS, COMPLETION, LR, WARMUP = "embedded:tiny-arith", 8, 16, 6, 5e-4, 5
REPORT = "--- profile report ---"  # a worker's report follows this line (the frameworks print above it)
# --profile: a category's time is the cumulative time of its entry points ("path:function"; the two sides'
# entry points are disjoint, so one list serves both). The rest of the profiled time is the framework's.
CATEGORIES = {
    "generation (model.generate)": ["generation/utils.py:generate"],
    "training forward (log-probs)": [
        "trl/trainer/grpo_trainer.py:_get_per_token_logps_and_entropies",
        "exgrpo_pl/step/rollout.py:completion_logps",
    ],
    "backward": ["torch/autograd/__init__.py:backward"],
    "optimizer step + grad clipping": [
        "torch/optim/adam.py:step", "transformers/trainer.py:_clip_grad_norm",
        "exgrpo_pl/step/update.py:_clip_gradients",
    ],
    "decode + rewards": [
        "tokenization_utils_base.py:batch_decode", "trl/trainer/grpo_trainer.py:_calculate_rewards",
        "exgrpo_pl/rewards/base.py:compute_rewards",
    ],
}  # fmt: skip


class StepClock:
    """Times each step; with a profiler, profiles from the first step after warm-up to the end of the last.

    The profiled span also holds what each framework does between its step hooks (data loading, logging),
    which the step times leave out.
    """

    def __init__(self, steps: int, profiler=None):
        self.times, self.steps, self.profiler = [], steps, profiler

    def begin(self):
        if self.profiler is not None and len(self.times) == WARMUP:
            self.profiler.enable()
        self.started = time.perf_counter()

    def end(self):
        self.times.append(time.perf_counter() - self.started)
        if self.profiler is not None and len(self.times) == self.steps:
            self.profiler.disable()


def run_ours(steps: int, workdir: str, profiler=None) -> list[float]:
    from lightning.pytorch import Callback, Trainer

    from exgrpo_pl.data import ArithmeticTask, PromptDataModule
    from exgrpo_pl.module import ExGRPOModule

    class Hooks(Callback):
        def on_train_batch_start(self, *args):
            clock.begin()

        def on_train_batch_end(self, *args):
            clock.end()

    clock = StepClock(steps, profiler)
    module = ExGRPOModule(MODEL, num_generations=K, max_completion_length=COMPLETION, learning_rate=LR)
    data = PromptDataModule(synthetic=ArithmeticTask(2000, seed=0), batch_size=PROMPTS)
    trainer = Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[Hooks()],
        default_root_dir=workdir,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return clock.times


def run_trl(steps: int, workdir: str, profiler=None, bf16: bool = False) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from exgrpo_pl.data import ArithmeticTask
    from exgrpo_pl.models import load_policy, load_tokenizer, resolve_model_path
    from exgrpo_pl.rewards import ArithmeticReward

    class Hooks(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            clock.begin()

        def on_step_end(self, *args, **kwargs):
            clock.end()

    train_rows, _ = ArithmeticTask(2000, seed=0).split(0.1)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in train_rows])
    config = GRPOConfig(
        output_dir=workdir, max_steps=steps, per_device_train_batch_size=PROMPTS * K, num_generations=K,
        max_completion_length=COMPLETION, learning_rate=LR, lr_scheduler_type="constant", loss_type="dapo",
        scale_rewards="group", beta=0.0, gradient_checkpointing=False, use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1000, max_grad_norm=1.0, disable_tqdm=True, bf16=bf16,
    )  # fmt: skip
    clock = StepClock(steps, profiler)
    trainer = GRPOTrainer(
        model=load_policy(MODEL), reward_funcs=[ArithmeticReward()], args=config, train_dataset=dataset,
        processing_class=load_tokenizer(resolve_model_path(MODEL)), callbacks=[Hooks()],
    )  # fmt: skip
    trainer.train()
    return clock.times


def worker(variant: str, steps: int, profile: bool = False, trl_bf16: bool = False) -> None:
    """One run in this process; prints its step times and peak memory as JSON on the last line, or with
    `profile` the profile report after the line REPORT."""
    import torch

    torch.manual_seed(0)
    profiler = cProfile.Profile() if profile else None
    with tempfile.TemporaryDirectory() as workdir:
        if variant == "TRL":
            times = run_trl(steps, workdir, profiler, bf16=trl_bf16)
        else:
            times = run_ours(steps, workdir, profiler)
    if profiler is not None:
        print(REPORT, profile_report(variant, pstats.Stats(profiler), times[WARMUP:]), sep="\n")
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": statistics.mean(times[WARMUP:]), "peak_bytes": peak}))


def profile_report(variant: str, stats: pstats.Stats, times: list[float]) -> str:
    """Seconds per step and share of each category, then the top functions by cumulative and own time."""
    n, total = len(times), stats.total_tt / len(times)  # the whole profiled span, between-step work included
    lines = [
        f"== {variant}: {n} steps under cProfile, {total:.3f} s/step profiled "
        f"({statistics.mean(times):.3f} s/step by the step clock)",
        f"{'category':42s} {'s/step':>7s} {'share':>6s}",
    ]
    rest = total
    for category, entries in CATEGORIES.items():
        seconds = sum(
            cumulative / n
            for (path, _, name), (_, _, _, cumulative, _) in stats.stats.items()
            if any(f"{path}:{name}".endswith(entry) for entry in entries)
        )
        rest -= seconds
        lines.append(f"{category:42s} {seconds:7.3f} {seconds / total:6.0%}")
    lines.append(f"{'rest (framework, loss, metrics, logging)':42s} {rest:7.3f} {rest / total:6.0%}")
    for order in ("cumulative", "tottime"):  # tottime: time in the function itself, where the CPU goes
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats(order).print_stats(12)
        table = out.getvalue()[out.getvalue().index("   ncalls") :].rstrip()
        for prefix in (sysconfig.get_paths()["purelib"], str(ROOT)):
            table = table.replace(prefix + "/", "")
        lines += [f"top 12 by {order}:", table]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--profile", action="store_true", help="profile 8 steps of each side; saves nothing")
    parser.add_argument("--trl-bf16", action="store_true", help="TRL with GRPOConfig's default bf16 autocast")
    parser.add_argument("--worker", choices=["TRL", "exgrpo-pl"], help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help="rounds of (TRL, ours); default 4, 2 with --quick")
    parser.add_argument(
        "--steps", type=int, help=f"steps a run, the first {WARMUP} warm-up; default 60, 30 with --quick"
    )
    args = parser.parse_args()
    rounds, steps = (1, WARMUP + 8) if args.profile else (2, 30) if args.quick else (4, 60)
    rounds, steps = args.rounds or rounds, args.steps or steps
    if steps <= WARMUP:
        parser.error(f"--steps {steps}: a run needs more than its {WARMUP} warm-up steps")
    if args.worker:
        worker(args.worker, args.steps, args.profile, args.trl_bf16)
        return
    flags = ["--profile"] * args.profile + ["--trl-bf16"] * args.trl_bf16
    results: dict[str, list[dict]] = {"TRL": [], "exgrpo-pl": []}
    for _ in range(rounds):
        for variant in results:  # A, B, A, B: drift on the machine hits both alike
            out = subprocess.run(
                [sys.executable, __file__, "--worker", variant, "--steps", str(steps), *flags],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            if args.profile:
                print(out.stdout[out.stdout.index(REPORT) + len(REPORT) :])
            else:
                results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.profile:
        print("cProfile charges each Python call, so Python-heavy framework code looks bigger than it is.")
        return

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
    suffix = ("_quick" if args.quick else "") + ("_trl_bf16" if args.trl_bf16 else "")
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

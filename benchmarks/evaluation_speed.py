"""Evaluation throughput next to training's, on the quickstart's model and task, measured side by side.

A named evaluation set of the reasoning task's held-out questions, each sampled k times at T = 0.6 (the
paper's protocol, `PromptDataModule(eval_sets=...)`) in batches of `val_batch_size` problems, against
training steps of the quickstart's shape (32 questions x 8 rollouts, generation and update). Both report
completions per second; rounds alternate the two so that machine noise hits them alike, and the ratio is
taken within each round.

    python benchmarks/evaluation_speed.py             # 3 rounds
    python benchmarks/evaluation_speed.py --rounds 1  # a quick look

Writes benchmarks/results/evaluation_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.data import EvalSet, PromptDataModule, ReasoningTask
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import ReasoningReward

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"


class Clock(Callback):
    """Seconds of each training step after the first (which warms up), and of each validation."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.validations: list[float] = []

    def on_train_batch_start(self, *args) -> None:
        self._step = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step > 1:
            self.steps.append(time.perf_counter() - self._step)

    def on_validation_start(self, *args) -> None:
        self._validation = time.perf_counter()

    def on_validation_end(self, *args) -> None:
        self.validations.append(time.perf_counter() - self._validation)


def module() -> ExGRPOModule:
    """The quickstart's module (configs/quickstart.yaml's model, reward and lengths)."""
    return ExGRPOModule(
        model_name_or_path="embedded:tiny-reasoning", reward_funcs=[ReasoningReward(check_steps=True)],
        num_generations=8, max_completion_length=29, learning_rate=3e-4, loss_type="dapo",
        scale_rewards="none", val_temperature=0.6, reward_timeout_seconds=None,
    )  # fmt: skip


def one_round(directory: str, problems: int, samples: int, batch: int, steps: int) -> dict:
    """Seconds and completions of `steps` training steps and of one evaluation of `problems` x `samples`."""
    seed_everything(0)
    task = ReasoningTask(num_questions=20000, seed=0)
    clock = Clock()
    eval_set = {"held_out": EvalSet(synthetic=ReasoningTask(problems, seed=9), num_samples=samples)}
    data = PromptDataModule(
        synthetic=task, val_fraction=0.0, batch_size=32, val_batch_size=batch, eval_sets=eval_set
    )
    trainer = Trainer(
        accelerator="cpu", max_steps=steps + 1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[clock],
        default_root_dir=directory,
    )  # fmt: skip
    policy = module()
    trainer.fit(policy, datamodule=data)
    validator = Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        callbacks=[clock],
        default_root_dir=directory,
    )
    validator.validate(policy, datamodule=data, verbose=False)
    train_rate = 32 * 8 * len(clock.steps) / sum(clock.steps)
    eval_rate = problems * samples / clock.validations[-1]
    return {"train_completions_per_s": train_rate, "eval_completions_per_s": eval_rate}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--problems", type=int, default=500)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--val-batch-size", type=int, default=500, help="problems per evaluation batch")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per round")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rounds = []
    with tempfile.TemporaryDirectory() as directory:
        for index in range(args.rounds):
            figures = one_round(directory, args.problems, args.samples, args.val_batch_size, args.steps)
            figures["ratio"] = figures["eval_completions_per_s"] / figures["train_completions_per_s"]
            rounds.append(figures)
            print(
                f"round {index}: evaluation {figures['eval_completions_per_s']:.0f} completions/s, training"
                f" {figures['train_completions_per_s']:.0f} completions/s (generation and update),"
                f" ratio {figures['ratio']:.2f}",
                flush=True,
            )
    ratios = [r["ratio"] for r in rounds]
    result = {
        "problems": args.problems, "samples": args.samples, "val_batch_size": args.val_batch_size,
        "rounds": rounds, "median_ratio": statistics.median(ratios),
        "eval_prompts_x_samples_per_s": statistics.median(r["eval_completions_per_s"] for r in rounds),
        "train_completions_per_s": statistics.median(r["train_completions_per_s"] for r in rounds),
    }  # fmt: skip
    print(
        f"\nevaluation / training completions per second: median {result['median_ratio']:.2f}"
        f" (rounds {min(ratios):.2f}-{max(ratios):.2f})"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "evaluation_speed.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

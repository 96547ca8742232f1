"""What ReplayCallback's contract checks cost: per step in a real run, and alone on large batches.

1. Trains examples/own_module.py's GRPO module on the embedded policy (8 prompts x K=4, 6-token completions)
   with a ReplayCallback in mix and in swap mode (replay probability 0.5, so both kinds of step occur), timing
   every call of the callback's StepChecker and every training step. Reports the median check time of
   on-policy and replay steps (the cheap checks), the first step of each kind (the field checks too), and
   the median step time.
2. Times the checks alone on a paper-sized mixed batch (128 questions x K=8 = 1024 rows, 1024-token
   completions), and the RolloutBatch constructor with and without its bool-dtype check.

    python benchmarks/contract_checks.py            # 40 steps per mode
    python benchmarks/contract_checks.py --steps 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.contract import Experience
from exgrpo_pl.contract_checks import StepChecker, check_experience_used, check_rollouts
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.step.groups import assemble_groups, plan_rollouts

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def load_example():
    spec = importlib.util.spec_from_file_location("own_module", ROOT / "examples" / "own_module.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StepTimes(Callback):
    """Seconds from one on_train_batch_start to the on_train_batch_end of the same step (every hook)."""

    def __init__(self):
        self.seconds = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self.started)


def timed_checker(checker: StepChecker) -> list[tuple[str, bool, float]]:
    """Wrap `checker` so each step records (kind, first of its kind, seconds of both checks)."""
    records: list[tuple[str, bool, float]] = []
    check_batch, check_outputs = checker.check_batch, checker.check_outputs
    pending = {}

    def timed_batch(batch):
        started = time.perf_counter()
        check_batch(batch)
        pending["batch"] = time.perf_counter() - started

    def timed_outputs(outputs, batch, k):
        experience = batch.get("experience")
        kind = "fresh" if experience is None else experience.mode
        first = kind not in checker.checked
        started = time.perf_counter()
        rollouts = check_outputs(outputs, batch, k)
        records.append((kind, first, pending.pop("batch", 0.0) + time.perf_counter() - started))
        return rollouts

    checker.check_batch, checker.check_outputs = timed_batch, timed_outputs
    return records


def run(mode: str, steps: int) -> dict:
    example = load_example()
    seed_everything(0)
    replay = ReplayCallback(
        mode=mode,
        min_buffer_size=1,
        replay=SelectiveReplay(strategy="uniform", replay_probability=0.5, seed=0),
    )
    records = timed_checker(replay._contract)
    step_times = StepTimes()
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
            callbacks=[step_times, replay],
        )  # fmt: skip
        data = PromptDataModule(synthetic=ArithmeticTask(num_questions=500), batch_size=8)
        trainer.fit(example.GRPO(), data)
    us = lambda values: round(statistics.median(values) * 1e6, 1) if values else None  # noqa: E731
    return {
        "steps": steps,
        "replay_steps": replay.replayed_steps,
        "median_step_ms": round(statistics.median(step_times.seconds) * 1e3, 1),
        "checks_us_on_policy_step": us([s for k, first, s in records if k == "fresh" and not first]),
        "checks_us_replay_step": us([s for k, first, s in records if k != "fresh" and not first]),
        "checks_us_first_step_of_each_kind": {k: round(s * 1e6, 1) for k, first, s in records if first},
    }


def large_batch() -> tuple[Experience, RolloutBatch]:
    """A mixed step of 128 questions x K=8 with 64 replayed, 256-token prompts, 1024-token completions."""
    b, k, prompt, completion = 128, 8, 256, 1024
    stored_ids = torch.arange(1000, 1064)
    n_stored = len(stored_ids)

    def rows(question_ids, replayed):
        n = len(question_ids)
        return RolloutBatch(
            question_ids=question_ids, prompt_ids=torch.ones(n, prompt, dtype=torch.long),
            prompt_mask=torch.ones(n, prompt, dtype=torch.bool),
            completion_ids=torch.randint(3, 30000, (n, completion)),
            completion_mask=torch.ones(n, completion, dtype=torch.bool),
            behaviour_logps=-torch.rand(n, completion), rewards=torch.rand(n),
            correct=torch.ones(n, dtype=torch.bool), entropy=torch.rand(n), advantages=torch.zeros(n),
            policy_version=torch.zeros(n, dtype=torch.long),
            replayed=torch.full((n,), replayed), prompts=["p"] * n, completions=[""] * n, answers=["a"] * n,
        )  # fmt: skip

    experience = Experience("mix", rows(stored_ids, True))
    batch = {
        "prompt": ["p"] * b,
        "question_id": torch.arange(b),
        "answer": ["a"] * b,
        "experience": experience,
    }
    plan = plan_rollouts(batch, k)
    fresh = rows(plan.question_ids.repeat_interleave(torch.tensor(plan.repeats)), False)
    assert len(fresh) == (b - n_stored) * k + n_stored * (k - 1)
    return experience, assemble_groups(plan, fresh, "group")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the tiny model gains nothing from threads; a shared machine makes them spin
    results = {mode: run(mode, args.steps) for mode in ("mix", "swap")}

    experience, rollouts = large_batch()
    repeat = 20
    per_call = lambda fn: round(min(timeit.repeat(fn, number=repeat, repeat=5)) / repeat * 1e6, 1)  # noqa: E731
    fields = {name: getattr(rollouts, name) for name in RolloutBatch.__dataclass_fields__}
    bool_fields = ("prompt_mask", "completion_mask", "correct", "replayed")
    results["large_mixed_batch_1024_rows"] = {
        "check_experience_used_us": per_call(lambda: check_experience_used(experience, rollouts)),
        "check_rollouts_us": per_call(lambda: check_rollouts(rollouts, 8)),
        "rolloutbatch_constructor_us": per_call(lambda: RolloutBatch(**fields)),
        "its_bool_dtype_check_us": per_call(
            lambda: [fields[name].dtype != torch.bool for name in bool_fields]  # what __post_init__ adds
        ),
    }
    print(json.dumps(results, indent=2))
    (RESULTS / "contract_checks.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()

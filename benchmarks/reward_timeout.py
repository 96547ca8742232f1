"""The per-call cost of `compute_rewards`'s time limit, for each shipped reward and a plain function.

Under a limit a reward function runs in a worker process (one per process, killed when a call runs over),
unless it is marked `in_process` (the linear-time verifiers, and `MathVerifyReward`, whose per-answer limit
already kills a worker of its own): those are called directly, as without a limit. This prints, for a
batch of 8 prompts x 8 completions, the median milliseconds per `compute_rewards` call over several rounds,
with no limit and with one, and the difference: what the limit adds to each reward function's call (once
per function per training step), and the first limited call, which starts the worker (once per process;
the worker imports what the reward's module imports, torch for the shipped ones).

    python benchmarks/reward_timeout.py     # 7 rounds of 200 calls; writes results/reward_timeout.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

from exgrpo_pl.rewards import (
    ArithmeticReward,
    ExactMatchReward,
    FormatReward,
    ReasoningReward,
    compute_rewards,
)

RESULTS = Path(__file__).parent / "results"


def plain(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A user's reward function: not marked `in_process`, so a limit runs it in the worker process."""
    return [1.0 if completion.startswith("1") else 0.0 for completion in completions]


def batch(completions: int) -> tuple[list[str], list[str], dict[str, list[str]]]:
    """Prompts, completions and columns that every shipped reward accepts (a sum and its derivation)."""
    prompts = ["12-7+30="] * completions
    texts = ["12-7=5;5+30=35", "35", "12-7=6;6+30=36", "thirty-five"] * (completions // 4)
    return prompts, texts, {"answer": ["35"] * completions}


def seconds_per_call(fn, calls: int, completions: int, timeout_seconds: float | None) -> float:
    """Mean seconds per `compute_rewards` call over `calls` calls."""
    prompts, texts, columns = batch(completions)
    started = time.perf_counter()
    for _ in range(calls):
        compute_rewards([fn], None, prompts, texts, columns, timeout_seconds=timeout_seconds)
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--completions", type=int, default=64)
    args = parser.parse_args()
    rewards = {
        "ArithmeticReward": ArithmeticReward(),
        "ReasoningReward": ReasoningReward(check_steps=True),
        "ExactMatchReward": ExactMatchReward(),
        "FormatReward": FormatReward(r"[0-9].*"),
        # By its module's name, as a reward in a user's package: the worker cannot load a script's `__main__`.
        "plain function": importlib.import_module(Path(__file__).stem).plain,
    }
    results = {}
    for name, fn in rewards.items():
        first = seconds_per_call(fn, 1, args.completions, 60.0)  # starts the worker, if it runs in one
        seconds_per_call(fn, 20, args.completions, 60.0)  # warm-up
        # Alternate the two so that machine noise hits both alike.
        runs: dict[str, list[float]] = {"no limit": [], "limit": []}
        for _ in range(args.rounds):
            runs["no limit"].append(seconds_per_call(fn, args.calls, args.completions, None) * 1e3)
            runs["limit"].append(seconds_per_call(fn, args.calls, args.completions, 60.0) * 1e3)
        median = {way: statistics.median(values) for way, values in runs.items()}
        path = "direct" if getattr(fn, "in_process", False) else "worker process"
        results[name] = {"path": path, "first_call_s": first, "ms_per_call": median, "rounds": runs}
        print(
            f"{name:>17} ({path:>14}): no limit {median['no limit']:.3f} ms, limit {median['limit']:.3f} ms"
            f" per call of {args.completions} completions: the limit adds"
            f" {median['limit'] - median['no limit']:.3f} ms (medians of {args.rounds} rounds); first limited"
            f" call {first:.2f} s"
        )
    summary = {"settings": vars(args), "rewards": results}
    (RESULTS / "reward_timeout.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()

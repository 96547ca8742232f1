"""The per-call cost of `compute_rewards`'s time limit: a trivial reward scored with and without a limit.

A limited call runs in a fresh daemon thread that the caller waits for; this prints the median time per
`compute_rewards` call over several rounds of `--calls` calls each, both ways, and the difference: what the
limit adds to each reward function's call (once per function per training step).

    python benchmarks/reward_timeout.py                 # 7 rounds of 1000 calls, 8 completions each
"""

from __future__ import annotations

import argparse
import statistics
import time

from exgrpo_pl.rewards import compute_rewards


def trivial(prompts: list[str], completions: list[str], **columns) -> list[float]:
    return [1.0] * len(completions)


def seconds_per_call(calls: int, completions: int, timeout_seconds: float | None) -> float:
    """Mean seconds per `compute_rewards` call over `calls` calls."""
    prompts, texts = ["p"] * completions, ["c"] * completions
    started = time.perf_counter()
    for _ in range(calls):
        compute_rewards([trivial], None, prompts, texts, {}, timeout_seconds=timeout_seconds)
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--completions", type=int, default=8)
    args = parser.parse_args()
    seconds_per_call(100, args.completions, 60.0)  # warm-up
    # Alternate the two so that machine noise hits both alike.
    runs: dict[str, list[float]] = {"no limit": [], "limit": []}
    for _ in range(args.rounds):
        runs["no limit"].append(seconds_per_call(args.calls, args.completions, None))
        runs["limit"].append(seconds_per_call(args.calls, args.completions, 60.0))
    median = {name: statistics.median(values) * 1e3 for name, values in runs.items()}
    for name, values in runs.items():
        spread = f"{min(values) * 1e3:.3f} to {max(values) * 1e3:.3f}"
        print(f"{name:>8}: {median[name]:.3f} ms per call (median of {args.rounds} rounds; {spread})")
    print(f"the limit adds {median['limit'] - median['no limit']:.3f} ms per reward function call")


if __name__ == "__main__":
    main()

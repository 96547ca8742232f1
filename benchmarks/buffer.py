"""TrajectoryBuffer at scale: add throughput, sample(size=256) latency per strategy, memory vs raw payload.

Fills a buffer with N trajectories of 512 completion tokens (64-token prompts), K = 8 per question with
Bernoulli rewards of a per-question success rate, then times `sample` for every strategy and measures the
resident memory the buffer added against the raw payload (token ids as int32 + behaviour log-probs as
float32), once full and again after adding half as many more (the oldest evicted: holes and compaction).
While adding that second half, each add is followed by one timed `sample` (strategies in turn): the
latency a training step sees, which includes catching up with the add (the bucketer's rate order).
Latencies are wall time and the process's CPU time; on a shared machine the two part when other processes
hold the cores. torch runs on one thread: the buffer is single-threaded NumPy, and torch's idle workers,
woken by this script's own data generation, would otherwise spin next to it and be counted in its CPU
time. Targets: sample p50 <= 2 ms at 100K; memory <= 1.2x the raw payload.
Writes benchmarks/results/buffer.{json,png}.

    python benchmarks/buffer.py --quick        # 20K trajectories
    python benchmarks/buffer.py                # 100K trajectories
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.buffer import STRATEGIES, TrajectoryBuffer
from exgrpo_pl.difficulty import DifficultyBucketer

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
PROMPT, COMPLETION, K, CHUNK = 64, 512, 8, 256


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def make_chunk(first_question: int, generator: torch.Generator) -> RolloutBatch:
    """CHUNK trajectories: CHUNK / K questions, K rollouts each, rewards drawn at a per-question rate."""
    n = CHUNK
    questions = torch.arange(first_question, first_question + n // K).repeat_interleave(K)
    rate = torch.rand(n // K, generator=generator).repeat_interleave(K)
    rewards = (torch.rand(n, generator=generator) < rate).float()
    lengths = torch.randint(COMPLETION // 2, COMPLETION + 1, (n,), generator=generator)
    lengths[::4] = COMPLETION  # a quarter use the whole budget
    completion_mask = torch.arange(COMPLETION).unsqueeze(0) < lengths.unsqueeze(1)
    return RolloutBatch(
        question_ids=questions,
        prompt_ids=torch.randint(3, 30000, (n, PROMPT), generator=generator),
        prompt_mask=torch.ones(n, PROMPT, dtype=torch.bool),
        completion_ids=torch.randint(3, 30000, (n, COMPLETION), generator=generator) * completion_mask,
        completion_mask=completion_mask,
        behaviour_logps=-torch.rand(n, COMPLETION, generator=generator) * completion_mask,
        rewards=rewards,
        correct=rewards > 0.5,
        entropy=torch.rand(n, generator=generator),
        advantages=torch.zeros(n),
        policy_version=torch.zeros(n, dtype=torch.long),
        replayed=torch.zeros(n, dtype=torch.bool),
        group_size=K,
        prompts=["p"] * n,
        completions=["c"] * n,
        answers=["a"] * n,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="20K trajectories instead of 100K")
    parser.add_argument("--samples", type=int, default=200, help="sample() calls per strategy")
    args = parser.parse_args()
    size = 20_000 if args.quick else 100_000
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    # Chunks are made one at a time and dropped after their add, so the resident memory that grows is the
    # buffer's (the allocator reuses one chunk's worth of transient memory).
    make_chunk(0, torch.Generator().manual_seed(1))
    gc.collect()
    before = rss_bytes()
    # retirement off: questions with 8/8 correct would otherwise leave, and the buffer would hold fewer.
    chunks = size // CHUNK  # whole chunks fill the buffer exactly, so eviction drops whole chunks
    buffer = TrajectoryBuffer(max_size=chunks * CHUNK, bucketer=DifficultyBucketer(retire_from=None))
    payloads, add_seconds = [], []
    after_add = {strategy: [] for strategy in STRATEGIES}
    sampler = torch.Generator().manual_seed(1)

    def sample(strategy: str) -> tuple[float, float]:
        return timed(lambda: buffer.sample(strategy, size=256, generator=sampler))

    for i in range(chunks + chunks // 2):
        if i == chunks:  # full: measure memory, then keep adding (evicting the oldest)
            gc.collect()
            used = rss_bytes() - before
            payload = sum(payloads)
        chunk = make_chunk(i * CHUNK // K, generator)
        payloads.append(int(chunk.completion_mask.sum()) * 8 + int(chunk.prompt_mask.sum()) * 4)
        started = time.perf_counter()
        buffer.add(chunk)
        add_seconds.append(time.perf_counter() - started)
        del chunk
        if i >= chunks:
            strategy = list(STRATEGIES)[i % len(STRATEGIES)]
            after_add[strategy].append(sample(strategy))
    gc.collect()
    churned_used, churned_payload = rss_bytes() - before, sum(payloads[-chunks:])  # eviction is oldest first
    fill_rate = chunks * CHUNK / sum(add_seconds[:chunks])
    churn_rate = (len(add_seconds) - chunks) * CHUNK / sum(add_seconds[chunks:])

    latencies = {}
    for strategy in STRATEGIES:
        wall, cpu = np.array([sample(strategy) for _ in range(args.samples)]).T
        after_wall, after_cpu = np.array(after_add[strategy]).T
        latencies[strategy] = {
            "p50_ms": 1000 * float(np.percentile(wall, 50)),
            "p99_ms": 1000 * float(np.percentile(wall, 99)),
            "cpu_p50_ms": 1000 * float(np.percentile(cpu, 50)),
            "after_add_p50_ms": 1000 * float(np.percentile(after_wall, 50)),
            "after_add_cpu_p50_ms": 1000 * float(np.percentile(after_cpu, 50)),
            "after_add_calls": len(after_wall),
            "rows": len(buffer.sample(strategy, size=256, generator=sampler)),
        }

    print(
        f"buffer of {len(buffer)} trajectories ({PROMPT}-token prompts, up to {COMPLETION}-token completions)"
    )
    print(f"add: {fill_rate:,.0f} trajectories/s filling, {churn_rate:,.0f}/s when full ({CHUNK} per call)")
    print(f"memory: {used / 2**20:,.0f} MiB resident for {payload / 2**20:,.0f} MiB raw payload "
          f"= {used / payload:.2f}x full, {churned_used / churned_payload:.2f}x after evicting "
          f"{len(add_seconds) - chunks} x {CHUNK} (target <= 1.2x)")  # fmt: skip
    print(f"sample(size=256): {args.samples} calls per strategy; 'after add': one call after each of "
          f"the last {len(add_seconds) - chunks} adds, strategies in turn (target p50 <= 2 ms)")  # fmt: skip
    print(f"{'strategy':32s} {'p50 ms':>8s} {'p99 ms':>8s} {'CPU p50':>8s} {'after add p50':>14s} "
          f"{'(CPU)':>6s} {'rows':>6s}")  # fmt: skip
    for strategy, f in latencies.items():
        print(f"{strategy:32s} {f['p50_ms']:8.2f} {f['p99_ms']:8.2f} {f['cpu_p50_ms']:8.2f} "
              f"{f['after_add_p50_ms']:14.2f} {f['after_add_cpu_p50_ms']:6.2f} {f['rows']:6d}")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    result = {"size": len(buffer), "add_per_s": fill_rate, "add_per_s_when_full": churn_rate,
              "memory_ratio": used / payload, "memory_ratio_after_eviction": churned_used / churned_payload,
              "sample": latencies}  # fmt: skip
    (RESULTS / f"buffer{suffix}.json").write_text(json.dumps(result, indent=1))
    _plot(latencies, len(buffer), RESULTS / f"buffer{suffix}.png")


def timed(call) -> tuple[float, float]:
    """(wall, CPU) seconds that `call()` took."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def _plot(latencies: dict, size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(latencies)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = {"p50": "p50_ms", "p50 after an add": "after_add_p50_ms", "CPU p50": "cpu_p50_ms", "p99": "p99_ms"}
    for i, (label, key) in enumerate(bars.items()):
        ax.bar(x + (i - 1.5) * 0.2, [latencies[n][key] for n in names], 0.2, label=label)
    ax.axhline(2.0, color="red", linestyle="--", linewidth=1, label="target p50")
    ax.set_xticks(x, [n.replace("_", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("sample(size=256) ms")
    ax.set_title(f"TrajectoryBuffer.sample at {size // 1000}K trajectories")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

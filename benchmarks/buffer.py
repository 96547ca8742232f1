"""TrajectoryBuffer at scale: add throughput, sample(size=256) latency per strategy, memory vs raw payload,
and the memory of the questions' dataset columns.

Fills a buffer with N trajectories of 512 completion tokens (64-token prompts), K = 8 per question with
Bernoulli rewards of a per-question success rate, each question with the dataset columns of a verl row (the
paper's data, loaded with `answer_column="reward_model.ground_truth"`: `answer`, `data_source`, `ability`,
`reward_model`, `extra_info`), then times `sample` for every strategy and measures the resident memory the
buffer added against the raw payload (token ids as int32 + behaviour log-probs as float32), once full and
again after adding half as many more (the oldest evicted: holes and compaction). The columns are kept once
per question; their figures: the Python objects one question's take (`sys.getsizeof` over the copies the
buffer holds, each question's counted whole, as rows parsed from a file have their own strings), their
total at the full buffer, their bytes in a checkpoint, and the time `add` spends checking and copying them.
While adding that second half, each add is followed by one timed `sample` (strategies in turn): the
latency a training step sees, which includes catching up with the add (the bucketer's rate order).
Latencies are wall time and the process's CPU time; on a shared machine the two part when other processes
hold the cores. torch runs on one thread: the buffer is single-threaded NumPy, and torch's idle workers,
woken by this script's own data generation, would otherwise spin next to it and be counted in its CPU
time. Targets: sample p50 <= 2 ms at 100K; memory <= 1.2x the raw payload (the columns included).
Writes benchmarks/results/buffer.{json,png}.

    python benchmarks/buffer.py --quick        # 20K trajectories
    python benchmarks/buffer.py                # 100K trajectories
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience import DifficultyBucketer
from exgrpo_pl.experience.buffer import STRATEGIES, TrajectoryBuffer

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
PROMPT, COMPLETION, K, CHUNK = 64, 512, 8, 256
SOURCES = ("openr1_math", "aime24", "amc23", "math500")


def verl_columns(question: int) -> dict:
    """One question's dataset columns as a verl row loads (`tests/data/samples/verl`), with a ground truth
    such as "24", "\\frac{3}{4}", "5\\sqrt{2}" or "(1, 7)"."""
    a, b = question % 997, question % 89 + 2
    truth = (str(a), f"\\frac{{{a}}}{{{b}}}", f"{a}\\sqrt{{{b}}}", f"({a}, {b})")[question % 4]
    source = SOURCES[question % len(SOURCES)]
    return {
        "answer": truth,
        "data_source": source,
        "ability": "math",
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": question, "split": "train"},
    }


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
    # One row's values per question, repeated K times by reference, as the collector repeats them.
    rows = [verl_columns(q) for q in questions[::K].tolist() for _ in range(K)]
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
        answers=[row["answer"] for row in rows],
        columns={key: [row[key] for row in rows] for key in rows[0]},
    )


def deep_size(value, seen: set[int]) -> int:
    """Bytes of the Python objects `value` is made of (`sys.getsizeof`), each object in `seen` once."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(deep_size(k, seen) + deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        size += sum(deep_size(item, seen) for item in value)
    return size


def column_figures(buffer: TrajectoryBuffer, generator: torch.Generator) -> dict:
    """The per-question dataset columns of the (full) buffer: Python bytes per question and in all, bytes
    in a checkpoint, and the time `add` spends checking and copying them (on 32 more chunks).

    Measured after the memory and the latencies: its garbage (a checkpoint's worth of bytes among it) would
    change how the allocator serves the buffer's large arrays, and so what they cost."""
    copy_seconds = []
    for i in range(32):
        chunk = make_chunk(10**9 + i * CHUNK // K, generator)  # questions never added
        started = time.perf_counter()
        chunk.question_columns(range(CHUNK))
        copy_seconds.append(time.perf_counter() - started)
    questions = buffer.policy_snapshot["question_ids"].unique().tolist()
    columns = [buffer.question_columns(q) for q in questions]
    per_question = [deep_size(value, set()) for value in columns]
    saved = io.BytesIO()  # the state dict's entries, without the rest of the state
    torch.save({"column_question_ids": torch.tensor(questions), "columns": columns}, saved)
    return {
        "questions": len(questions),
        "bytes_per_question": float(np.mean(per_question)),
        "total_bytes": float(np.sum(per_question) + sys.getsizeof(dict.fromkeys(questions))),  # + the table
        "checkpoint_bytes_per_question": saved.tell() / len(questions),
        "copy_us_per_question": 1e6 * float(np.median(copy_seconds)) / (CHUNK // K),
    }


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
    columns = column_figures(buffer, generator)

    print(
        f"buffer of {len(buffer)} trajectories ({PROMPT}-token prompts, up to {COMPLETION}-token completions)"
    )
    print(f"add: {fill_rate:,.0f} trajectories/s filling, {churn_rate:,.0f}/s when full ({CHUNK} per call)")
    print(f"memory: {used / 2**20:,.0f} MiB resident for {payload / 2**20:,.0f} MiB raw payload "
          f"= {used / payload:.2f}x full, {churned_used / churned_payload:.2f}x after evicting "
          f"{len(add_seconds) - chunks} x {CHUNK} (target <= 1.2x)")  # fmt: skip
    print(f"dataset columns of a verl row, kept once per question: {columns['bytes_per_question']:,.0f} B "
          f"per question, {columns['total_bytes'] / 2**20:,.1f} MiB for the {columns['questions']:,} "
          f"questions of the full buffer; {columns['checkpoint_bytes_per_question']:,.0f} B per question in "
          f"a checkpoint; add checks and copies them in {columns['copy_us_per_question']:.1f} us per "
          "question")  # fmt: skip
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
              "columns": columns, "sample": latencies}  # fmt: skip
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

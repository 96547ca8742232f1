"""The paper's per-problem metrics over k samples, and their means over a set.

For a problem sampled n times with c correct:

- avg@k: c / n, the mean correctness of the samples (the paper's "avg@32" on AIME and AMC);
- pass@k: the chance that at least one of k samples drawn without replacement from the n is correct, the
  unbiased estimator of Chen et al. (2021), 1 - C(n - c, k) / C(n, k);
- maj@k: whether the answer most samples agree on is correct (only where answers can be compared: the
  reward function extracts them);
- greedy pass@1: whether the one greedy (temperature 0) completion is correct.

A set's figure is the mean over its problems, each problem weighing the same however many samples it has.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with `c` correct out of `n` samples.

    Computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), which equals 1 - C(n - c, k) / C(n, k) without
    the binomials' overflow.

    Args:
        n: samples drawn, >= k.
        c: correct samples, 0 <= c <= n.
        k: the budget, 1 <= k <= n.
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(correct: Sequence[bool]) -> float:
    """Mean correctness of one problem's samples."""
    if not correct:
        raise ValueError("avg_at_k needs at least one sample")
    return sum(map(bool, correct)) / len(correct)


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> float | None:
    """Whether the answer given most often is correct: 1.0 or 0.0; None when no sample has an answer.

    Samples without an answer (None) do not vote. A tie goes to the answer given first, so the result does
    not depend on anything but the samples' order.

    Args:
        answers: each sample's extracted answer, None where it has none.
        correct: each sample's correctness (the same for samples with the same answer).
    """
    if len(answers) != len(correct):
        raise ValueError(f"majority_correct got {len(answers)} answers for {len(correct)} samples")
    votes = Counter(answer for answer in answers if answer is not None)
    if not votes:
        return None
    top = max(votes.values())
    winner = next(answer for answer in answers if answer is not None and votes[answer] == top)
    return float(bool(correct[answers.index(winner)]))


@dataclass
class ProblemSamples:
    """What was sampled for one problem of an evaluation set.

    Args:
        correct: each sample's correctness.
        lengths: each sample's completion length in tokens.
        truncated: whether each sample ran into the length limit without a stop token.
        answers: each sample's extracted answer (None where it has none); None when the reward cannot
            extract answers, and maj@k is then not reported.
        greedy_correct: the greedy completion's correctness, None when none was sampled.
        domain: the problem's domain (its `data_source`), None for a set without domains.
        question_id: the problem's question id, None where unknown.
    """

    correct: list[bool]
    lengths: list[int]
    truncated: list[bool]
    answers: list[str | None] | None = None
    greedy_correct: bool | None = None
    domain: str | None = None
    question_id: int | None = None


def summarize(problems: Sequence[ProblemSamples], k: int | None = None) -> dict[str, float]:
    """A set's metrics, the means over its problems: `avg@k`, `pass@k` (and `pass@1`), `maj@k` (the vote
    of each problem's first k samples) where every problem has answers, `greedy_pass@1` where every problem
    has a greedy sample, `mean_length` and `clipped_ratio` (over samples), and `problems`, `samples`.

    Args:
        problems: one entry per problem.
        k: the budget of pass@k and maj@k; None: the fewest samples any problem has.
    """
    if not problems:
        raise ValueError("summarize needs at least one problem")
    n_min = min(len(p.correct) for p in problems)
    k = n_min if k is None else k
    if not 1 <= k <= n_min:
        raise ValueError(f"k={k}: every problem needs at least k samples (the fewest has {n_min})")
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    samples = [length for p in problems for length in p.lengths]
    figures = {
        f"avg@{k}": mean([avg_at_k(p.correct) for p in problems]),
        f"pass@{k}": mean([pass_at_k(len(p.correct), sum(p.correct), k) for p in problems]),
        "mean_length": mean(samples) if samples else 0.0,
        "clipped_ratio": mean([float(t) for p in problems for t in p.truncated]) if samples else 0.0,
        "problems": float(len(problems)),
        "samples": float(sum(len(p.correct) for p in problems)),
    }
    if k > 1:
        figures["pass@1"] = mean([pass_at_k(len(p.correct), sum(p.correct), 1) for p in problems])
    if all(p.answers is not None for p in problems):
        votes = [majority_correct(p.answers[:k], p.correct[:k]) for p in problems]
        figures[f"maj@{k}"] = mean([0.0 if v is None else v for v in votes])
    if all(p.greedy_correct is not None for p in problems):
        figures["greedy_pass@1"] = mean([float(p.greedy_correct) for p in problems])
    return figures

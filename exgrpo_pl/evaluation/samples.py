"""From an evaluation batch's rollouts to one `ProblemSamples` per problem.

Plain PyTorch: the rows of a `RolloutBatch` as `RolloutCollector.collect` returns them, each prompt's
`repeats[i]` rows next to each other, prompts in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.evaluation.metrics import ProblemSamples


def clipped_rows(rollouts: RolloutBatch, max_new_tokens: int, stop_ids: Sequence[int]) -> torch.Tensor:
    """`[N]` bool: the rows that used the whole budget without ending on a stop token (cut at the limit)."""
    lengths = rollouts.completion_mask.sum(1)
    last = rollouts.completion_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    stopped = torch.isin(last, torch.tensor(list(stop_ids), dtype=last.dtype, device=last.device))
    return (lengths >= max_new_tokens) & ~stopped


def problem_samples(
    rollouts: RolloutBatch,
    repeats: Sequence[int],
    clipped: torch.Tensor,
    question_ids: Sequence[int] | None = None,
    answer_of: Callable[[str, Mapping[str, Any]], str | None] | None = None,
    domains: Sequence[str | None] | None = None,
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> list[ProblemSamples]:
    """One `ProblemSamples` per prompt of `rollouts`.

    Args:
        rollouts: `sum(repeats)` rows, prompt by prompt.
        repeats: samples of each prompt.
        clipped: `[N]` bool, rows cut at the length limit (`clipped_rows`).
        question_ids: each prompt's question id, or None.
        answer_of: `answer_of(completion text, the prompt's columns)` extracts a completion's answer for maj@k
            (`exgrpo_pl.rewards.by_source.extract_answer` of a reward function); None: no maj@k.
        domains: each prompt's domain, or None.
        columns: the prompts' dataset columns (column -> one value per prompt), which `answer_of` gets, each
            prompt its own values; None: none.
    """
    if sum(repeats) != len(rollouts):
        raise ValueError(f"problem_samples: repeats add up to {sum(repeats)} for {len(rollouts)} rows")
    correct = rollouts.correct.tolist()
    lengths = rollouts.completion_mask.sum(1).tolist()
    cut = clipped.tolist()
    problems, start = [], 0
    for i, count in enumerate(repeats):
        rows = slice(start, start + count)
        start += count
        row = {key: values[i] for key, values in (columns or {}).items()}
        answers = [answer_of(text, row) for text in rollouts.completions[rows]] if answer_of else None
        problems.append(
            ProblemSamples(
                correct=[bool(c) for c in correct[rows]],
                lengths=[int(n) for n in lengths[rows]],
                truncated=[bool(t) for t in cut[rows]],
                answers=answers,
                domain=domains[i] if domains is not None else None,
                question_id=question_ids[i] if question_ids is not None else None,
            )
        )
    return problems

"""What a training step samples: the batch's fresh questions and, in mix mode, the replayed ones (each with
one rollout fewer, its stored trajectory completing the group), as a `RolloutPlan`.

Part of `exgrpo_pl.step.groups` (see there for the whole step); plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import Experience
from exgrpo_pl.contract_checks import check_answers

# Batch keys the plan consumes itself; every other list-valued key is a dataset column for the rewards.
RESERVED_KEYS = ("prompt", "question_id", "experience")


@dataclass
class RolloutPlan:
    """What one training step samples, and the stored rows it trains on besides.

    Args:
        prompts: prompt strings to sample from: the batch's fresh questions, then the replayed ones.
        question_ids: `[len(prompts)]` long.
        repeats: rollouts to sample per prompt: K for a fresh question, K-1 for a replayed one.
        columns: dataset columns per prompt (reward-function keyword arguments). A replayed question carries
            the columns stored with it (`RolloutBatch.columns`), the values its fresh rollouts were scored
            with; the keys are the union of the batch's and the replayed questions', None where a question
            lacks one, as a dataset holds None where a row lacks a column.
        experience: the replayed rows (`replayed` True), or None.
        mode: "fresh" (no experience), "mix" or "swap".
        group_size: K.
    """

    prompts: list[str]
    question_ids: Tensor
    repeats: list[int]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    experience: RolloutBatch | None = None
    mode: str = "fresh"
    group_size: int = 1

    # Completions to sample in all: one row of the fresh `RolloutBatch` each.
    num_rollouts: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_rollouts = sum(self.repeats)

    def expand(self, values: list[Any]) -> list[Any]:
        """Per-prompt values repeated into per-rollout rows (the order `assemble_groups` expects)."""
        if len(values) != len(self.prompts):
            raise ValueError(f"expand got {len(values)} values for {len(self.prompts)} prompts")
        return [v for v, r in zip(values, self.repeats) for _ in range(r)]


def dataset_columns(batch: dict) -> dict[str, list[Any]]:
    """The dataset columns of a batch that reward functions receive as keyword arguments."""
    return {
        key: list(value)
        for key, value in batch.items()
        if key not in RESERVED_KEYS and isinstance(value, (list, tuple))
    }


def plan_rollouts(batch: dict, num_generations: int) -> RolloutPlan:
    """What a step with this batch samples (see the module docstring for the three cases).

    Args:
        batch: a training batch: `prompt` (list of str), `question_id` (`[B]` long), optional dataset columns
            (lists), optional `experience` (an `Experience`, put there by `ReplayCallback`).
        num_generations: K, rollouts per question.
    """
    for key in ("prompt", "question_id"):
        if key not in batch:
            raise ValueError(
                f"training batch has no {key!r} key (it has {sorted(batch)}): batches must be dicts with "
                "'prompt' (list of str) and 'question_id' ([B] long tensor), as exgrpo_pl.data.collate_rows "
                "makes them"
            )
    k = num_generations
    experience: Experience | None = batch.get("experience")
    question_ids = torch.as_tensor(batch["question_id"], dtype=torch.long)
    columns = dataset_columns(batch)
    if experience is None or experience.placement == "refill":  # refill: a pool the module draws on later
        n = len(batch["prompt"])
        return RolloutPlan(list(batch["prompt"]), question_ids, [k] * n, columns, group_size=k)
    stored = experience.rollouts
    if experience.mode == "swap":
        return RolloutPlan([], question_ids[:0], [], {}, stored, "swap", group_size=k)
    check_answers(batch)  # the fresh questions' answers are stored, to score a later replay's rollouts
    n_fresh = max(len(batch["prompt"]) - len(stored), 0)
    replayed = _replayed_columns(stored)
    # The union of keys, as TRL passes every dataset column to every row (None where a row has no value).
    keys = [*columns, *(key for key in replayed if key not in columns)]
    fresh_none, stored_none = [None] * n_fresh, [None] * len(stored)
    columns = {
        key: list(columns.get(key, fresh_none)[:n_fresh]) + list(replayed.get(key, stored_none))
        for key in keys
    }
    return RolloutPlan(
        prompts=list(batch["prompt"][:n_fresh]) + list(stored.prompts),
        question_ids=torch.cat([question_ids[:n_fresh], stored.question_ids.cpu()]),
        repeats=[k] * n_fresh + [k - 1] * len(stored),
        columns=columns,
        experience=stored,
        mode="mix",
        group_size=k,
    )


def _replayed_columns(stored: RolloutBatch) -> dict[str, list[Any]]:
    """The dataset columns of replayed rows: those stored with them (`RolloutBatch.columns`, which the buffer
    fills), else, for rows built without, their `answers` and `domains`."""
    if stored.columns is not None:
        return stored.columns
    columns: dict[str, list[Any]] = {"answer": list(stored.answers) or [None] * len(stored)}
    if stored.domains is not None:
        columns["domain"] = list(stored.domains)
    return columns

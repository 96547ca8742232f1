"""Which rollouts a training step generates, and how they and replayed experience become GRPO groups.

The bookkeeping a GRPO step needs to honour `batch["experience"]` (see `exgrpo_pl.contract`), as two pure
functions, so any GRPO module (ours, or your own) trains replay the same way:

    plan = plan_rollouts(batch, num_generations)     # what to sample: plan.prompts x plan.repeats
    fresh = ...                                      # sample and score them: a RolloutBatch, one row each
    rollouts = assemble_groups(plan, fresh, "group") # the groups to train on, with advantages

- No experience: every question of the batch gets K fresh rollouts.
- Mix (the paper): the batch's last `len(experience)` questions give way to the replayed questions. Each
  replayed question gets K-1 fresh rollouts, and its group is its stored trajectory followed by them;
  advantages are computed over all K.
- Swap (the seed): nothing is generated; the step trains on the replayed rows alone, with their stored
  baseline advantage put on the scale of on-policy ones (`replay_advantages`).

Plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import Experience
from exgrpo_pl.losses import SCALE_REWARDS, group_advantages

# Batch keys the plan consumes itself; every other list-valued key is a dataset column for the rewards.
RESERVED_KEYS = ("prompt", "question_id", "experience")


@dataclass
class RolloutPlan:
    """What one training step samples, and the stored rows it trains on besides.

    Args:
        prompts: prompt strings to sample from: the batch's fresh questions, then the replayed ones.
        question_ids: `[len(prompts)]` long.
        repeats: rollouts to sample per prompt: K for a fresh question, K-1 for a replayed one.
        columns: dataset columns per prompt (reward-function keyword arguments). Replayed questions carry
            only their `answer` (and `domain` when the batch has one); their other columns are None.
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

    @property
    def num_rollouts(self) -> int:
        """Completions to sample in all: one row of the fresh `RolloutBatch` each."""
        return sum(self.repeats)

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
    if experience is None:
        n = len(batch["prompt"])
        return RolloutPlan(list(batch["prompt"]), question_ids, [k] * n, columns, group_size=k)
    stored = experience.rollouts
    if experience.mode == "swap":
        return RolloutPlan([], question_ids[:0], [], {}, stored, "swap", group_size=k)
    n_fresh = max(len(batch["prompt"]) - len(stored), 0)
    answers = columns.get("answer", [None] * len(batch["prompt"]))
    columns = {key: values[:n_fresh] + [None] * len(stored) for key, values in columns.items()}
    columns["answer"] = answers[:n_fresh] + list(stored.answers)
    if stored.domains is not None and "domain" in columns:
        columns["domain"][n_fresh:] = stored.domains
    return RolloutPlan(
        prompts=list(batch["prompt"][:n_fresh]) + list(stored.prompts),
        question_ids=torch.cat([question_ids[:n_fresh], stored.question_ids.cpu()]),
        repeats=[k] * n_fresh + [k - 1] * len(stored),
        columns=columns,
        experience=stored,
        mode="mix",
        group_size=k,
    )


def assemble_groups(plan: RolloutPlan, fresh: RolloutBatch | None, scale_rewards: str) -> RolloutBatch:
    """The rows to train on, grouped by question, with advantages.

    Args:
        plan: the step's `plan_rollouts`.
        fresh: the sampled and scored rollouts of `plan`: `plan.num_rollouts` rows in `plan.expand` order
            (each prompt's rollouts next to each other, prompts in plan order). None in swap mode.
        scale_rewards: "group", "batch" or "none", as for `group_advantages`.

    Returns:
        A `RolloutBatch` with `group_size` K (1 in swap mode) and `advantages` set. In mix mode each replayed
        question's group is its stored row followed by its K-1 fresh rows, after the fresh questions' groups.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}; allowed: {', '.join(SCALE_REWARDS)}")
    k = plan.group_size
    if plan.mode == "swap":
        rows = plan.experience
        if fresh is not None and len(fresh):
            raise ValueError("a swap-mode step samples nothing: pass fresh=None")
        return replace(rows, advantages=replay_advantages(rows.rewards, rows.advantages, k, scale_rewards))
    _check_fresh(plan, fresh)
    if plan.mode == "fresh":
        rollouts = fresh.select(torch.arange(len(fresh)), group_size=k)
    else:
        stored = plan.experience.to(fresh.question_ids.device)
        n_fresh = len(plan.prompts) - len(stored)
        order = list(range(n_fresh * k))
        for j in range(len(stored)):
            order.append(len(fresh) + j)
            start = n_fresh * k + j * (k - 1)
            order.extend(range(start, start + k - 1))
        rollouts = RolloutBatch.cat([fresh, stored], group_size=1).select(order, group_size=k)
    rollouts.advantages = group_advantages(rollouts.rewards, k, scale_rewards)
    return rollouts


def replay_advantages(rewards: Tensor, baselines: Tensor, num_generations: int, scale_rewards: str) -> Tensor:
    """Swap-mode advantages on the scale of on-policy ones. `[N]`, `[N]` -> `[N]`.

    A swap-mode row's stored advantage is `r - p`, its reward minus its question's current correctness rate
    (a fresh baseline: the buffer computes it when it samples the row). On-policy advantages under "group"
    scaling are divided by the std of the question's K rewards; for 0/1 rewards at rate p that std is
    sqrt(p (1 - p) K / (K - 1)) (unbiased, as `group_advantages` computes it), so the replayed advantage
    is divided by the same number, computed from p; "batch" divides by the std of the batch's rewards, as
    on-policy rows are; "none" keeps `r - p`. Without this a replayed step under "group" scaling would be
    about half the size of an on-policy one.

    Args:
        rewards: `[N]` the rows' rewards.
        baselines: `[N]` the stored advantages `r - p`.
        num_generations: K of the on-policy groups whose scale to match.
        scale_rewards: "group", "batch" or "none".
    """
    if scale_rewards == "none":
        return baselines
    if scale_rewards == "batch":
        return baselines / (rewards.std() + 1e-4)
    rate = (rewards - baselines).clamp(0.0, 1.0)  # [N] p, recovered from r - p
    k = num_generations
    std = (rate * (1 - rate) * k / (k - 1)).sqrt()  # [N]
    return baselines / (std + 1e-4)


def _check_fresh(plan: RolloutPlan, fresh: RolloutBatch | None) -> None:
    """Say what is wrong when `fresh` does not hold the plan's rollouts in the plan's order."""
    if fresh is None:
        raise ValueError(f"a {plan.mode!r} step needs its {plan.num_rollouts} sampled rollouts, got None")
    if len(fresh) != plan.num_rollouts:
        raise ValueError(
            f"the plan samples {plan.num_rollouts} rollouts (repeats {plan.repeats}), the fresh RolloutBatch "
            f"has {len(fresh)} rows: sample plan.prompts[i] exactly plan.repeats[i] times"
        )
    expected = plan.question_ids.repeat_interleave(torch.tensor(plan.repeats, dtype=torch.long))
    if not torch.equal(fresh.question_ids.cpu(), expected):
        raise ValueError(
            "the fresh RolloutBatch's question_ids are not in plan order: rows must be "
            "plan.expand(plan.question_ids.tolist()), each prompt's rollouts next to each other"
        )
    if bool(fresh.replayed.any()):
        raise ValueError("fresh rollouts must have replayed=False; the stored rows come from plan.experience")

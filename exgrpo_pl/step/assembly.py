"""How a step's sampled rollouts and its replayed rows become GRPO groups with advantages: fresh groups of
K, mixed groups (stored row first, then its K-1 fresh rows), or swap-mode rows with advantages on the
on-policy scale.

Part of `exgrpo_pl.step.groups` (see there for the whole step); plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.step.losses import SCALE_REWARDS, SumOverRanks, batch_std, group_advantages
from exgrpo_pl.step.plan import RolloutPlan


def assemble_groups(
    plan: RolloutPlan,
    fresh: RolloutBatch | None,
    scale_rewards: str,
    sum_over_ranks: SumOverRanks | None = None,
) -> RolloutBatch:
    """The rows to train on, grouped by question, with advantages.

    Args:
        plan: the step's `plan_rollouts`.
        fresh: the sampled and scored rollouts of `plan`: `plan.num_rollouts` rows in `plan.expand` order
            (each prompt's rollouts next to each other, prompts in plan order). None in swap mode.
        scale_rewards: "group", "batch" or "none", as for `group_advantages`.
        sum_over_ranks: under data parallelism, sums a tensor over the ranks (an all-reduce), so that "batch"
            scaling divides by the std of every rank's rewards; every rank must then call this together.
            None: this rank's rows are the whole batch.

    Returns:
        A `RolloutBatch` with `group_size` K (1 in swap mode) and `advantages` set. In mix mode each
            replayed question's group is its stored row followed by its K-1 fresh rows, after the fresh
            questions' groups.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}; allowed: {', '.join(SCALE_REWARDS)}")
    k = plan.group_size
    if plan.mode == "swap":
        rows = plan.experience
        if fresh is not None and len(fresh):
            raise ValueError("a swap-mode step samples nothing: pass fresh=None")
        advantages = replay_advantages(rows.rewards, rows.advantages, k, scale_rewards, sum_over_ranks)
        return replace(rows, advantages=advantages)
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
    rollouts.advantages = group_advantages(rollouts.rewards, k, scale_rewards, sum_over_ranks=sum_over_ranks)
    return rollouts


def replay_advantages(
    rewards: Tensor,
    baselines: Tensor,
    num_generations: int,
    scale_rewards: str,
    sum_over_ranks: SumOverRanks | None = None,
) -> Tensor:
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
        sum_over_ranks: as for `assemble_groups`: the "batch" std is that of every rank's rewards.
    """
    if scale_rewards == "none":
        return baselines
    if scale_rewards == "batch":
        return baselines / (batch_std(rewards, sum_over_ranks) + 1e-4)
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

"""Refill (`ReplayCallback(placement="refill")`): after a step's fresh groups are scored, a group whose K
rewards are all equal (no GRPO gradient, whatever the scaling) gives its place to a replayed question, its
stored trajectory and K-1 rollouts sampled in a second, smaller generation round.

    idle = idle_groups(rollouts.rewards, k)                  # [G] which groups would teach nothing
    n = <min over ranks of min(idle.sum(), len(pool))>        # generation is collective under ZeRO-3
    plan = refill_plan(pool, n, k)                            # the second round: K-1 rollouts of n questions
    fresh = ...                                               # sample and score plan, as the first round
    trained, gave_way = refilled(rollouts, idle, plan, fresh, "group")

Part of a step (see `exgrpo_pl.step.groups`); plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import Experience
from exgrpo_pl.step.assembly import assemble_groups
from exgrpo_pl.step.losses import SumOverRanks, group_advantages
from exgrpo_pl.step.plan import RolloutPlan, plan_rollouts


def idle_groups(rewards: Tensor, k: int) -> Tensor:
    """`[G]` bool: the groups of `rewards` (`[G * K]`, groups contiguous) whose K rewards are all equal."""
    groups = rewards.view(-1, k)  # [G, K]
    return (groups == groups[:, :1]).all(1)


def refill_plan(pool: RolloutBatch, n: int, k: int) -> RolloutPlan:
    """The second round: the pool's first `n` stored rows, K-1 rollouts of each, scored with the columns
    stored with them (a mixed plan without fresh questions)."""
    stored = pool.select(torch.arange(n))
    empty = {"prompt": [], "question_id": stored.question_ids[:0].cpu(), "answer": []}
    return plan_rollouts({**empty, "experience": Experience("mix", stored)}, k)


def refilled(
    rollouts: RolloutBatch,
    idle: Tensor,
    plan: RolloutPlan,
    fresh: RolloutBatch,
    scale_rewards: str,
    sum_over_ranks: SumOverRanks | None = None,
) -> tuple[RolloutBatch, RolloutBatch]:
    """(the rows to train on, the groups that gave way): the first `len(plan.experience)` idle groups of
    `rollouts` give their places to `plan`'s mixed groups (each stored row, then its K-1 rows of `fresh`),
    which follow the kept groups; advantages over the trained rows as `assemble_groups` computes them (a
    "batch" std is that of the trained rows, every rank calling together). The groups that gave way keep
    advantage 0: they are evidence of difficulty, not trained on."""
    k = rollouts.group_size
    n = len(plan.experience)
    gave = idle.nonzero().flatten()[:n]  # [n] group indices
    kept = torch.ones(len(idle), dtype=torch.bool, device=idle.device)
    kept[gave] = False
    offsets = torch.arange(k, device=idle.device)

    def rows(groups: Tensor) -> Tensor:  # [g] group indices -> [g * K] row indices
        return (groups[:, None] * k + offsets).reshape(-1)

    gave_way = rollouts.select(rows(gave), group_size=k)
    gave_way.advantages = torch.zeros_like(gave_way.rewards)
    mixed = assemble_groups(plan, fresh, "none").to(rollouts.question_ids.device)
    trained = RolloutBatch.cat([rollouts.select(rows(kept.nonzero().flatten()), group_size=k), mixed], k)
    trained.advantages = group_advantages(trained.rewards, k, scale_rewards, sum_over_ranks=sum_over_ranks)
    return trained, gave_way

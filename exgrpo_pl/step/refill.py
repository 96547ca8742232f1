"""Filling dead groups: after a step's groups are scored, a group whose K rewards are all equal (no GRPO
gradient, whatever the scaling) gives its place to another group sampled in a further generation round.
What fills the places is the one difference between three forms that share this code:

- replay (`ReplayCallback(placement="refill")`): the pool's first replayed questions, each its stored
  trajectory and K-1 new rollouts (`refill_plan`);
- fresh refill (`ExGRPOModule(dynamic_sampling="refill")`): as many fresh questions of the training stream,
  K rollouts each, placed whatever their rewards;
- DAPO's dynamic sampling (`ExGRPOModule(dynamic_sampling="dapo")`, verl's `algorithm.filter_groups`): rounds
  of a batch of fresh questions, of which only the groups whose rewards differ take places (`informative`).

    places = dead_places(rollouts)                           # [G] groups that would teach nothing
    n = <min over ranks of min(places.sum(), supply)>         # generation is collective under ZeRO-3
    plan = refill_plan(pool, n, k)  or  plan_rollouts(questions, k)
    fresh = ...                                               # sample and score plan, as the first round
    trained, gave_way = placed(rollouts, places, assemble_groups(plan, fresh, "none"))
    trained.advantages = advantages_of(trained.rewards, k, ...)      # once, over what is trained on

`refilled` does the last two lines; a module with an advantage definition of its own (`[G, K] -> [G, K]`)
passes it as `advantages=` and the trained groups get its advantages, not `group_advantages`'
(`ReplayMixin.replay_groups` refills this way with a module's sampler).

Part of a step (see `exgrpo_pl.step.groups`); plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import Experience
from exgrpo_pl.step.assembly import assemble_groups
from exgrpo_pl.step.losses import SumOverRanks, group_advantages
from exgrpo_pl.step.plan import RolloutPlan, plan_rollouts

DYNAMIC_SAMPLING = ("off", "refill", "dapo")
# A module's own advantage definition: `[G, K]` group rewards -> `[G, K]` advantages.
AdvantageFn = Callable[[Tensor], Tensor]


def idle_groups(rewards: Tensor, k: int) -> Tensor:
    """`[G]` bool: the groups of `rewards` (`[G * K]`, groups contiguous) whose K rewards are all equal."""
    groups = rewards.view(-1, k)  # [G, K]
    return (groups == groups[:, :1]).all(1)


def dead_places(rollouts: RolloutBatch) -> Tensor:
    """`[G]` bool: the groups that may give their place away: rewards all equal and no replayed row (a mixed
    group's stored row must be trained on, as its step's experience)."""
    k = rollouts.group_size
    replayed = rollouts.replayed.view(-1, k).any(1)  # [G]
    return idle_groups(rollouts.rewards, k) & ~replayed


def refill_plan(pool: RolloutBatch, n: int, k: int) -> RolloutPlan:
    """The second round of replay's refill: the pool's first `n` stored rows, K-1 rollouts of each, scored
    with the columns stored with them (a mixed plan without fresh questions)."""
    stored = pool.select(torch.arange(n))
    empty = {"prompt": [], "question_id": stored.question_ids[:0].cpu(), "answer": []}
    return plan_rollouts({**empty, "experience": Experience("mix", stored)}, k)


def informative(groups: RolloutBatch, n: int) -> tuple[RolloutBatch, RolloutBatch]:
    """(at most `n` groups of `groups` whose rewards differ, in order; the rest): DAPO's filter, whose
    groups of equal rewards and whose informative groups beyond `n` are sampled but not trained on."""
    k = groups.group_size
    keep = (~idle_groups(groups.rewards, k)).nonzero().flatten()[:n]  # [<= n] group indices
    chosen = torch.zeros(len(groups) // k, dtype=torch.bool, device=groups.rewards.device)
    chosen[keep] = True
    return _groups(groups, chosen), _groups(groups, ~chosen)


def placed(rollouts: RolloutBatch, places: Tensor, groups: RolloutBatch) -> tuple[RolloutBatch, RolloutBatch]:
    """(the rows to train on, the groups that gave way): the first `len(groups) / K` groups marked in
    `places` give way to `groups`, which follow the groups that stay. Advantages are left to the caller,
    computed once over what is trained on; the groups that gave way get advantage 0: they are evidence of
    difficulty, not trained on."""
    k = rollouts.group_size
    gave = places.nonzero().flatten()[: len(groups) // k]  # [n] group indices
    kept = torch.ones(len(places), dtype=torch.bool, device=places.device)
    kept[gave] = False
    gave_way = _groups(rollouts, ~kept)
    gave_way.advantages = torch.zeros_like(gave_way.rewards)
    trained = RolloutBatch.cat([_groups(rollouts, kept), groups.to(rollouts.question_ids.device)], k)
    return trained, gave_way


def refilled(
    rollouts: RolloutBatch,
    places: Tensor,
    plan: RolloutPlan,
    fresh: RolloutBatch,
    scale_rewards: str,
    sum_over_ranks: SumOverRanks | None = None,
    advantages: AdvantageFn | None = None,
) -> tuple[RolloutBatch, RolloutBatch]:
    """(the rows to train on, the groups that gave way): the first groups marked in `places` give their
    places to `plan`'s groups (a replayed question's stored row, then its K-1 rows of `fresh`; a fresh
    question's K rows), placed whatever their rewards; advantages over the trained rows (`advantages_of`).

    Args:
        rollouts: the step's scored groups of K.
        places: `[G]` bool, the groups that may give their place (`dead_places`).
        plan: the second round's plan (`refill_plan`, or `plan_rollouts` of fresh questions).
        fresh: its sampled and scored rollouts, in plan order.
        scale_rewards: "group", "batch" or "none", as `group_advantages` takes it (when `advantages` is None).
        sum_over_ranks: as for `assemble_groups` (a "batch" std is that of every rank's trained rows, every
            rank calling together).
        advantages: the module's own advantage definition, `[G, K]` rewards -> `[G, K]`; None:
            `group_advantages` under `scale_rewards`.
    """
    k = rollouts.group_size
    trained, gave_way = placed(rollouts, places, assemble_groups(plan, fresh, "none"))
    trained.advantages = advantages_of(trained.rewards, k, scale_rewards, sum_over_ranks, advantages)
    return trained, gave_way


def advantages_of(
    rewards: Tensor,
    k: int,
    scale_rewards: str,
    sum_over_ranks: SumOverRanks | None = None,
    advantages: AdvantageFn | None = None,
) -> Tensor:
    """`[N]` advantages of `rewards` (`[N]`, groups of `k` contiguous): the module's own definition
    `advantages` (`[G, K]` -> `[G, K]`) when given, else `group_advantages` under `scale_rewards`."""
    if advantages is None:
        return group_advantages(rewards, k, scale_rewards, sum_over_ranks=sum_over_ranks)
    return advantages(rewards.view(-1, k)).reshape(-1).to(rewards.dtype)


def _groups(rollouts: RolloutBatch, which: Tensor) -> RolloutBatch:
    """The groups marked in `which` (`[G]` bool), as a batch of groups of K."""
    k = rollouts.group_size
    offsets = torch.arange(k, device=which.device)
    rows = (which.nonzero().flatten()[:, None] * k + offsets).reshape(-1)  # [g * K]
    return rollouts.select(rows, group_size=k)

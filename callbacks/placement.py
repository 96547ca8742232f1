"""Where `ReplayCallback`'s experience goes in a mixed step (`placement`), and what each placement asks.

- "displace" (the paper): the batch's last questions give way to replayed ones, each its stored trajectory
  plus K-1 fresh rollouts.
- "join": a question of the batch that the buffer holds gets one of its own stored trajectories as a member
  of its group (K-1 fresh rollouts and the stored one). The callback draws among the batch's questions with
  the sampler's own rule, puts the drawn ones last in the batch and hands their stored rows as a mixed
  step's experience: the module's mix then replaces exactly those questions by themselves, so every fresh
  question stays and the step generates what a GRPO step does, less one rollout per joined group.
- "refill": the experience is a pool; after scoring its fresh groups, the module gives the places of groups
  whose K rewards are all equal (no GRPO gradient) to the pool's first questions, each with K-1 rollouts of
  a second, smaller generation round, as many on every rank. Needs a module whose step does this
  (`ExGRPOModule`), which says so in `replay_placements`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import CONTRACT_DOC, PLACEMENTS, ContractError

# The placements any module following the contract trains: both are a mixed step as `plan_rollouts` reads it.
CONTRACT_PLACEMENTS = ("displace", "join")
GROUPS_METRIC = {"join": "replay/joined_groups", "refill": "replay/refilled_groups"}  # logged each step


def check_options(callback) -> None:
    """Raises ValueError naming the option when `placement` is unknown or contradicts another option."""
    placement = callback.placement
    if placement not in PLACEMENTS:
        raise ValueError(f"ReplayCallback placement={placement!r}; allowed: {', '.join(PLACEMENTS)}")
    if placement == "displace":
        return
    if callback.mode != "mix":
        raise ValueError(
            f"ReplayCallback placement={placement!r} needs mode='mix': a swap step trains on stored rows "
            "alone and generates nothing, so there is no fresh group to join or refill"
        )
    if callback.displaced_questions != "discard":
        raise ValueError(
            f"ReplayCallback displaced_questions={callback.displaced_questions!r} with "
            f"placement={placement!r}: this placement displaces no fresh question, so there is nothing to "
            "defer; use displaced_questions='discard' (the default)"
        )


def check_module(callback, module) -> None:
    """Raises `ContractError` at setup when the module's step cannot place experience as `placement` asks:
    refill happens inside its step, so the module must say it does (`replay_placements`)."""
    hparams = getattr(module, "hparams", {})
    if callback.placement == "refill" and hparams.get("dynamic_sampling", "off") != "off":
        raise ValueError(
            f"ReplayCallback placement='refill' with {type(module).__name__} "
            f"dynamic_sampling={hparams['dynamic_sampling']!r}: both fill the places of dead groups "
            "(replayed questions, fresh ones); keep one (dynamic_sampling='off' for replay's refill)"
        )
    placements = getattr(module, "replay_placements", CONTRACT_PLACEMENTS)
    if callback.placement not in placements:
        raise ContractError(
            f"ReplayCallback placement={callback.placement!r}: {type(module).__name__}.training_step must "
            "score the fresh groups, give the places of those whose K rewards are all equal to the first "
            "rows of batch['experience'].rollouts (as many on every rank), sample K-1 rollouts of each in a "
            "second round and return what gave way under outputs['gave_way'], and declare it with "
            f"replay_placements = {(*placements, callback.placement)!r}. ExGRPOModule does; any module "
            f"trains placement='displace' and 'join'. See {CONTRACT_DOC}"
        )


def demand(callback, batch: dict, k: int) -> int:
    """How much this step asks of the buffer: swap mode, a whole batch of trajectories; mix mode, the rho
    share of its questions (at most all but one where they displace fresh ones), with `bounded_demand` at
    most the medium range's supply (for "join", among the batch's questions)."""
    questions = len(batch["prompt"])
    if callback.mode == "swap":
        return questions * k
    share = max(1, round(callback.mix_fraction * questions))
    if callback.placement == "displace" and callback.mix_fraction < 1:  # a fresh question is left
        share = min(share, questions - 1)
    if not callback.bounded_demand:
        return share
    medium = callback.replay.medium_range(callback.buffer)
    return min(share, callback.buffer.num_questions_in(medium, joinable(callback, batch)))


def joinable(callback, batch: dict) -> Tensor | None:
    """The question ids a step may draw among: the batch's for "join", None (all) otherwise."""
    if callback.placement != "join":
        return None
    return torch.as_tensor(batch["question_id"], dtype=torch.long).reshape(-1)


def put_last(batch: dict, question_ids: Tensor) -> None:
    """Reorders the batch's per-question entries in place so that `question_ids` come last, in that order:
    a mixed step replaces the batch's last `len(question_ids)` questions by the experience's rows, which are
    then the stored rows of those very questions."""
    ids = [int(q) for q in batch["question_id"]]
    where = {q: i for i, q in enumerate(ids)}
    last = [where[int(q)] for q in question_ids]
    order = [i for i in range(len(ids)) if i not in set(last)] + last
    for key, value in list(batch.items()):
        batch[key] = _reordered(value, order, len(ids))


def _reordered(value: Any, order: list[int], questions: int) -> Any:
    """A per-question entry (a list, tuple or tensor of an item per question) in `order`; others as is."""
    if isinstance(value, Tensor) and value.ndim and value.shape[0] == questions:
        return value[torch.tensor(order, device=value.device)]
    if isinstance(value, (list, tuple)) and len(value) == questions:
        return type(value)(value[i] for i in order)
    return value


def count_gave_way(buffer, gave_way: RolloutBatch | None) -> None:
    """Feeds the outcomes of the groups that gave their place to refill to the bucketer (a question solved
    K of K retires as after any step), storing none of their rows: they were never trained on, so they
    carry no behaviour log-probs."""
    if gave_way is None or not len(gave_way):
        return
    gave_way = gave_way.to("cpu")
    retired_now = buffer.bucketer.update(gave_way.question_ids, gave_way.rewards, gave_way.domains)
    if len(retired_now):
        buffer.remove_questions(retired_now)

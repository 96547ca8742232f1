"""How a step's rows are dealt to its optimizer updates, and how their micro-batches' statistics combine
into the step's (`exgrpo_pl.step.update.PolicyUpdate.update_policy`). Plain PyTorch."""

from __future__ import annotations

import torch
from torch import Tensor


def mini_batch_rows(num_rows: int, group_size: int, count: int, stored_only: bool = False) -> list[Tensor]:
    """The rows of each of a step's `count` optimizer updates: its groups (K consecutive rows each) dealt out
    in turn, group g to update g mod count, so every row is used once and each update holds the batch's
    share of replayed groups (the batch lists its fresh groups first).

    Args:
        num_rows: the step's rows on this rank.
        group_size: K; a swap step's stored rows are dealt K at a time too, or one at a time when they make
            fewer than `count` sets of K (they are independent trajectories).
        count: optimizer updates per pass (`steps_per_generation`).
        stored_only: the step is a swap replay step, its rows drawn from the replay buffer.

    Returns:
        `count` long tensors of row indices, in increasing order.

    Raises:
        ValueError: fewer groups than updates (a swap step: fewer stored rows), naming the cause.
    """
    groups = -(-num_rows // group_size)
    if stored_only and groups < count:
        group_size, groups = 1, num_rows
    if stored_only and groups < count:
        raise ValueError(
            f"ExGRPOModule steps_per_generation={count}: this swap replay step drew only {num_rows} stored "
            f"row(s) from the replay buffer, fewer than its {count} optimizer updates (each needs one); "
            "data.batch_size does not set how many a swap step draws. Lower steps_per_generation, use "
            "ReplayCallback mode='mix', or raise its min_buffer_size so replay starts with more stored rows"
        )
    if groups < count:
        raise ValueError(
            f"ExGRPOModule steps_per_generation={count}: a step has only {groups} groups of {group_size} "
            f"rows on this rank ({num_rows} rows), fewer than its updates; raise data.batch_size or lower "
            "steps_per_generation"
        )
    group_of_row = torch.arange(num_rows) // group_size  # [num_rows]
    return [torch.nonzero(group_of_row % count == update).squeeze(1) for update in range(count)]


_SUMMED = ("loss", "pg_weight", "replayed_pg_weight")  # normalised by the update's mini-batch already


def accumulate(
    totals: dict[str, float], shares: dict[str, float], values: dict[str, Tensor], weight: float, share: float
) -> None:
    """Sum the loss (and the policy-gradient weights) over micro-batches (each is already normalised by
    the update's mini-batch) and weigh it by the update's share of the step; weigh the rest by the
    micro-batch's `share` of the step's rows, which `shares` sums per statistic for `averaged`."""
    for key, value in values.items():
        totals[key] = totals.get(key, 0.0) + (weight if key in _SUMMED else share) * float(value)
        if key not in _SUMMED:
            shares[key] = shares.get(key, 0.0) + share


def averaged(totals: dict[str, float], shares: dict[str, float]) -> None:
    """Each averaged statistic over the micro-batches that reported it: `is_weight` comes only from those
    holding replayed rows, and a step stopped by a non-finite loss has fewer."""
    for key, share in shares.items():
        totals[key] /= share

"""How `ReplayCallback`'s ranks agree: all-reduced flags and counts, and Python objects gathered over a gloo
group (in CPU memory, whatever the default group's backend)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer


def max_across_ranks(trainer: Trainer, value: int) -> int:
    """The largest `value` over all ranks."""
    return _reduced(trainer, value, "max")


def min_across_ranks(trainer: Trainer, value: int) -> int:
    """The smallest `value` over all ranks."""
    return _reduced(trainer, value, "min")


def _reduced(trainer: Trainer, value: int, op: str) -> int:
    if trainer.world_size == 1:
        return value
    reduced = trainer.strategy.reduce(torch.tensor(value, device=trainer.strategy.root_device), reduce_op=op)
    return int(reduced)


def totals_and_means(trainer: Trainer, totals: dict[str, float], means: dict[str, float]) -> dict[str, float]:
    """`totals` summed and `means` averaged over all ranks, in one all-reduce, as floats. Every rank must
    pass the same names, in the same order.

    Args:
        trainer: the running trainer.
        totals: name -> this rank's number, to sum.
        means: name -> this rank's number, to average.
    """
    values = [float(value) for value in [*totals.values(), *means.values()]]
    if trainer.world_size > 1:
        summed = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        summed = trainer.strategy.reduce(summed, reduce_op="sum").tolist()
        values = summed[: len(totals)] + [value / trainer.world_size for value in summed[len(totals) :]]
    return dict(zip([*totals, *means], values))


def all_ranks(trainer: Trainer, flag: bool) -> bool:
    """True when `flag` holds on every rank, so every rank takes the same branch."""
    if trainer.world_size == 1:
        return flag
    agreed = trainer.strategy.reduce(
        torch.tensor(float(flag), device=trainer.strategy.root_device), reduce_op="mean"
    )
    return bool(agreed >= 1.0)


def rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


OBJECT_GROUPS_: dict[Any, Any] = {}  # the default group -> its gloo twin, made once


def object_group():
    """A gloo group of all ranks for gathering Python objects, which then stay in CPU memory.

    Made on first use, which every rank reaches at the same collective (a checkpoint save, a pass's
    retirement), and kept for the life of the default group.
    """
    world = dist.group.WORLD
    if world not in OBJECT_GROUPS_:
        OBJECT_GROUPS_.clear()
        OBJECT_GROUPS_[world] = dist.new_group(backend="gloo")
    return OBJECT_GROUPS_[world]


def union_across_ranks(ids) -> set[int]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(ids), group=object_group())
        return {i for part in gathered for i in part}
    return set(ids)

"""Resuming where a checkpoint left off: the fit loop's progress, and the global RNG state of every rank.

Lightning resumes exactly from a checkpoint saved in `on_train_batch_end` (`every_n_train_steps`): it goes
on with the next batch of the same epoch, or with the next epoch after the epoch's last batch. From a
checkpoint saved later in the same step, in `on_train_epoch_end` (`ModelCheckpoint`'s default, and
whenever `max_steps` stops a run, mid-epoch or not) or in `on_train_end`, it does not: it runs one more
batch counted in the finished epoch and then restarts the data of the next epoch, skips that epoch's
`on_train_epoch_start`, or counts a stopped epoch as finished (Lightning issue #19403).
`resumable_fit_progress` rewrites such a checkpoint's progress into the `on_train_batch_end` form, which
describes the same point of training.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_FIT = "fit_loop"
_EPOCHS = "epoch_progress"
_BATCHES = "epoch_loop.batch_progress"
_LOOP_STATE = "epoch_loop.state_dict"


def resumable_fit_progress(checkpoint: dict[str, Any]) -> bool:
    """Rewrites, in place, the fit-loop progress of a checkpoint saved after the training step of its last
    batch had ended (in `on_train_epoch_end` or `on_train_end`) as `on_train_batch_end` of that batch saves
    it. Other checkpoints are left alone.

    Args:
        checkpoint: a Lightning checkpoint dict, before Lightning restores its loops.

    Returns:
        Whether the progress was rewritten.
    """
    loop = checkpoint.get("loops", {}).get(_FIT)
    if not loop or _EPOCHS not in loop or _BATCHES not in loop:
        return False
    epochs, batches = loop[_EPOCHS], loop[_BATCHES]
    epoch, batch = epochs["total"], batches["total"]
    if not (batch["ready"] == batch["started"] == batch["processed"] == batch["completed"] > 0):
        return False  # saved within a batch (on_train_batch_end: completed = processed - 1), or before any
    if batches["current"]["completed"] == 0:
        return False  # saved at the start of an epoch, before its first batch
    if epoch["ready"] == epoch["started"] == epoch["processed"] == epoch["completed"] + 1:
        finished = ("processed",)  # in on_train_epoch_end: the epoch is processed, not completed
    elif epoch["ready"] == epoch["started"] == epoch["processed"] == epoch["completed"]:
        finished = ("processed", "completed")  # in on_train_end: the epoch counts as completed
    else:
        return False
    for progress in (epochs["total"], epochs["current"]):
        for key in finished:
            progress[key] -= 1
    for progress in (batches["total"], batches["current"]):
        progress["completed"] -= 1
    # Lightning counts the batch as stepped once more when it resumes from on_train_batch_end.
    loop[_LOOP_STATE]["_batches_that_stepped"] -= 1
    return True


def rng_states() -> dict[str, Any]:
    """Torch's global CPU generator state and, with CUDA, the current device's, of every rank, in rank
    order (each rank samples its own rollouts): `{"cpu": [uint8 tensor per rank], "cuda": [...] or None}`.
    Every rank must call it (it all-gathers)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    own = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if cuda else None}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own)
    else:
        gathered = [own]
    return {"cpu": [g["cpu"] for g in gathered], "cuda": [g["cuda"] for g in gathered]}


def restore_rng_states(states: dict[str, Any]) -> None:
    """Sets this rank's global CPU generator, and the current CUDA device's, to the states `rng_states`
    saved for it (Lightning makes each rank's device current before it restores a checkpoint).

    A run resumed by another number of ranks gives rank r the state of saved rank r modulo their number.

    Args:
        states: what `rng_states` returned.
    """
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    index = rank % len(states["cpu"])
    torch.set_rng_state(states["cpu"][index])
    cuda = states["cuda"][index]
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)

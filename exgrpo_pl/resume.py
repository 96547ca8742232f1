"""Resuming where a checkpoint left off: the fit loop's progress, and the global RNG state of every rank.

Lightning resumes exactly from a checkpoint saved in `on_train_batch_end` (`every_n_train_steps`) in the
middle of an epoch. From one saved after the epoch's last batch, or later in a step (`on_train_epoch_end`:
`ModelCheckpoint`'s default, and whenever `max_steps` stops a run; `on_train_end`), it does not: it runs one
more batch counted in the finished epoch, or skips the next epoch's `on_train_epoch_start` and counts its
progress one short, or counts a stopped epoch as finished (Lightning issue #19403). `resumable_fit_progress`
rewrites a checkpoint's progress into the form that describes the same point of training and that Lightning
resumes exactly from: mid-epoch, the `on_train_batch_end` form; after an epoch's last batch, the form of a
finished epoch whose successor has not begun. Resuming from the latter, Lightning counts one logging step too
many when validation is due at that point; `settle_resumed_step_count` takes it back.

    def on_load_checkpoint(self, checkpoint):            # a LightningModule's hooks (ExGRPOModule's do it)
        self._resumed_at = resumable_fit_progress(checkpoint)

    def on_train_start(self):
        if self._resumed_at == "epoch end":
            settle_resumed_step_count(self.trainer)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_FIT = "fit_loop"
_EPOCHS = "epoch_progress"
_BATCHES = "epoch_loop.batch_progress"
_LOOP_STATE = "epoch_loop.state_dict"
_KEYS = ("ready", "started", "processed", "completed")


def resumable_fit_progress(checkpoint: dict[str, Any]) -> str | None:
    """Rewrites, in place, the fit-loop progress of a checkpoint saved after a training batch into the form
    Lightning resumes exactly from (see the module docstring); other checkpoints are left alone.

    Args:
        checkpoint: a Lightning checkpoint dict, before Lightning restores its loops.

    Returns:
        "epoch end" or "mid-epoch" when the progress was rewritten to that form, else None.
    """
    loop = checkpoint.get("loops", {}).get(_FIT)
    if not loop or _EPOCHS not in loop or _BATCHES not in loop:
        return None
    epochs, batches = loop[_EPOCHS], loop[_BATCHES]
    epoch, batch = (epochs["total"][k] for k in _KEYS), (batches["total"][k] for k in _KEYS)
    e_ready, e_started, e_processed, e_completed = epoch
    b_ready, b_started, b_processed, b_completed = batch
    if not (b_ready == b_started == b_processed > 0 and batches["current"]["processed"] > 0):
        return None  # before any batch of the epoch, or inside one
    in_batch_end = b_completed == b_processed - 1  # saved in on_train_batch_end
    if not in_batch_end and b_completed != b_processed:
        return None
    if e_ready == e_started == e_processed + 1 == e_completed + 1:
        kind, index = "batch", e_completed  # on_train_batch_end, or on_validation_end inside the epoch loop
    elif e_ready == e_started == e_processed == e_completed + 1:
        kind, index = "epoch", e_completed  # on_train_epoch_end: processed, not completed
    elif e_ready == e_started == e_processed == e_completed > 0:
        kind, index = "end", e_completed - 1  # on_train_end: the epoch counts as completed
    else:
        return None
    if batches["is_last_batch"]:
        _set(epochs, {k: index + 1 for k in _KEYS})  # epoch `index` finished, the next one not begun
        batches["total"]["completed"] = b_processed
        batches["current"].update(dict.fromkeys(_KEYS, 0))
        batches["is_last_batch"] = False
        # Lightning counts a batch as stepped after on_train_batch_end and on_validation_end.
        stepped = 1 if kind == "batch" else 0
    elif kind == "batch":
        return None  # mid-epoch from on_train_batch_end or on_validation_end: Lightning resumes these itself
    else:
        _set(epochs, {"ready": index + 1, "started": index + 1, "processed": index, "completed": index})
        for progress in (batches["total"], batches["current"]):
            progress["completed"] = progress["processed"] - 1
        stepped = -1  # as on_train_batch_end saves it: Lightning counts the batch when it resumes
    loop[_LOOP_STATE]["_batches_that_stepped"] += stepped
    return "mid-epoch" if stepped < 0 else "epoch end"


def settle_resumed_step_count(trainer) -> None:
    """Takes back the logging step Lightning counts for the validation it skips when it resumes, with
    validation due, from a checkpoint that `resumable_fit_progress` rewrote to an epoch's end (it takes
    that validation for already run and counts the batch as stepped once more). Call in `on_train_start`.

    Args:
        trainer: the resumed run's trainer.
    """
    loop, fetcher = trainer.fit_loop.epoch_loop, trainer.fit_loop._data_fetcher
    if fetcher is None or not (loop.restarting and loop.restarted_on_last):
        return
    if loop._should_check_val_fx(fetcher):  # Lightning's own test, in TrainingEpochLoop.advance
        loop._batches_that_stepped -= 1


def _set(progress: dict[str, Any], total: dict[str, int]) -> None:
    """Sets the total counts to `total` and the current ones (this run's) to as much less as they were."""
    shift = {k: progress["current"][k] - progress["total"][k] for k in _KEYS}
    progress["total"].update(total)
    progress["current"].update({k: total[k] + shift[k] for k in _KEYS})


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

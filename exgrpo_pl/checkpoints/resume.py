"""Resuming where a checkpoint left off: the fit loop's progress, the global RNG state of every rank, the
training loader's position, and the run's own options.

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

Both read and write Lightning's private loop state, so they live in `exgrpo_pl.lightning_internals` (with
every other use of Lightning's private API, each checked against the installed version) and import from here.

A resumed run must not set its training loader up before the checkpoint's loops are restored: Lightning
then never loads the loader's saved pass and position (Lightning issue #20550).
`trainer.estimated_stepping_batches` sets it up when `max_epochs` is finite (every shipped config), so
`configure_optimizers` counts the steps with `estimated_stepping_batches(trainer)` instead;
`warn_if_loader_not_restored` says so when something else set the loader up early.

A resumed run keeps its own options (config files, command line). `warn_changed_options` lists those whose
values differ from the checkpoint's, and `use_run_optimizer_options` puts the learning rate and weight decay
back into the optimizer and schedule that Lightning restores with the checkpoint's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch.optim.lr_scheduler import LambdaLR

from exgrpo_pl.lightning_internals import (
    loader_states_pending,
    resumable_fit_progress,
    settle_resumed_step_count,
    training_batches,
)

__all__ = [
    "changed_options",
    "estimated_stepping_batches",
    "restore_rng_states",
    "resumable_fit_progress",
    "rng_states",
    "settle_resumed_step_count",
    "use_run_optimizer_options",
    "warn_changed_options",
    "warn_if_loader_not_restored",
]


def estimated_stepping_batches(trainer) -> int | float:
    """`trainer.estimated_stepping_batches`, by the same formula, without setting up the fit loop's training
    loader: that is set up after the checkpoint is restored, so a resumed run loads its saved pass and
    position (see the module docstring). The batches of an epoch are counted on a loader requested and
    prepared as Lightning prepares its own (distributed sampler, `limit_train_batches`), which is then
    dropped without being iterated.

    Args:
        trainer: the trainer, in `configure_optimizers` or later.
    """
    if trainer.max_epochs == -1 or trainer.limit_train_batches == 0 or trainer.train_dataloader is not None:
        return trainer.estimated_stepping_batches  # sets nothing up: no loader needed, or one is set up
    batches = training_batches(trainer)
    if batches == math.inf:
        return trainer.max_steps
    steps = math.ceil(batches / trainer.accumulate_grad_batches) * max(trainer.max_epochs, 1)
    return min(steps, trainer.max_steps) if trainer.max_steps != -1 else steps


def warn_if_loader_not_restored(trainer) -> None:
    """Warns when a resumed run's training loader was set up before the checkpoint was restored, so that
    Lightning never loaded its saved pass and position: the run goes on with other batches than the
    uninterrupted run would. Call in `on_train_start`.

    Args:
        trainer: the resumed run's trainer.
    """
    if loader_states_pending(trainer):  # Lightning clears them once it loads them
        rank_zero_warn(
            "Resuming: the training data loader was set up before the checkpoint was restored (for instance"
            " by reading trainer.estimated_stepping_batches before training starts), so its saved pass and"
            " position were not loaded: this run trains on other batches than the uninterrupted run. Count"
            " steps with exgrpo_pl.checkpoints.resume.estimated_stepping_batches(trainer) instead."
        )


def changed_options(checkpoint: dict[str, Any], module, datamodule=None) -> list[str]:
    """The options of `module` (and `datamodule`) whose values differ from those saved in `checkpoint`, one
    line each: `"model.learning_rate: 0.0003 in the checkpoint, 0.001 in this run"`. A resumed run keeps its
    own values (the rule of `exgrpo fit`, for a checkpoint file as for `last`).

    Args:
        checkpoint: a Lightning checkpoint dict.
        module: the LightningModule that loads it.
        datamodule: the run's LightningDataModule, or None.
    """
    pairs = [("model", checkpoint.get("hyper_parameters"), module.hparams)]
    if datamodule is not None:
        pairs.append(("data", checkpoint.get("datamodule_hyper_parameters"), datamodule.hparams))
    lines = []
    for prefix, saved, now in pairs:
        for name, value in (saved or {}).items():
            # "_instantiator", "_class_path": LightningCLI's bookkeeping, not options
            if not name.startswith("_") and name in now and _plain(value) != _plain(now[name]):
                lines.append(f"{prefix}.{name}: {value!r} in the checkpoint, {now[name]!r} in this run")
    return lines


def _plain(value: Any) -> Any:
    """Tuples as lists, mappings as dicts, recursively: how an option was given does not make it differ."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def warn_changed_options(checkpoint: dict[str, Any], module, datamodule=None, path: Any = None) -> None:
    """Warns, listing them, when options of the run differ from the checkpoint's (see `changed_options`).

    Args:
        checkpoint: a Lightning checkpoint dict.
        module: the LightningModule that loads it.
        datamodule: the run's LightningDataModule, or None.
        path: where the checkpoint came from, for the message.
    """
    lines = changed_options(checkpoint, module, datamodule)
    if lines:
        rank_zero_warn(
            f"Resuming from {path or 'a checkpoint'}: {len(lines)} option(s) differ from the checkpoint's,"
            " and this run uses its own values (so it does not continue the saved run exactly):\n  "
            + "\n  ".join(lines)
        )


def use_run_optimizer_options(optimizer, scheduler, learning_rate: float, weight_decay: float) -> None:
    """Puts this run's learning rate and weight decay back into an optimizer and a `LambdaLR` schedule just
    restored from a checkpoint (their saved state brings back the checkpoint's), when they differ: the base
    learning rate of the schedule, and the current rate at its step. Unchanged values are left alone.

    Args:
        optimizer: the restored optimizer (param groups with "lr", "initial_lr", "weight_decay").
        scheduler: its restored schedule; only a `LambdaLR` (every transformers schedule but the plateau one)
            gets the learning rate.
        learning_rate: this run's base learning rate.
        weight_decay: this run's weight decay.
    """
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay
    if not isinstance(scheduler, LambdaLR) or all(base == learning_rate for base in scheduler.base_lrs):
        return
    scheduler.base_lrs = [learning_rate] * len(optimizer.param_groups)
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = learning_rate
        group["lr"] = learning_rate * lr_lambda(scheduler.last_epoch)  # as LambdaLR.step sets it
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


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

    A run resumed by another number of ranks gives rank r the state of saved rank r modulo their number,
    and warns that it is not the uninterrupted run.

    Args:
        states: what `rng_states` returned.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    saved = len(states["cpu"])
    if saved != world_size:
        rank_zero_warn(
            f"Resuming: sampling RNG states saved by {saved} rank(s) are resumed by {world_size}; rank r"
            f" takes saved rank r % {saved}'s, so this run samples other rollouts than the uninterrupted run."
        )
    index = rank % saved
    torch.set_rng_state(states["cpu"][index])
    cuda = states["cuda"][index]
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)

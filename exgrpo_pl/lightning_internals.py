"""Every use of Lightning's private API in exgrpo-pl, in one module, each checked against Lightning 2.6.6.

Lightning 2.6 has no public hook for any of these; each says what it relies on.
tests/test_lightning_internals.py checks that the installed Lightning still has each private name, signature
and call site relied on here, and fails when one changes (or when its version leaves `CHECKED_VERSIONS`),
before a change underneath silently brings Lightning's own behaviour back.

- `ModelCheckpointHooks`: `ModelCheckpoint`'s private save, "last" lookup, link and removal, routed to named
  hooks (`SafeModelCheckpoint` implements them), and the private helpers and attributes it reads.
- `resumable_fit_progress`, `settle_resumed_step_count`: the fit loop's progress, in a checkpoint before
  Lightning restores it and in the restored loop (`exgrpo_pl.checkpoints.resume` explains why).
- `training_batches`, `loader_states_pending`: how the fit loop sets its training data up.
- `batches_that_stepped`, `should_update_logs`: Lightning's logging-step count.
- `attached_trainer`: a LightningModule's trainer, or None where the public property raises.
- `deepspeed_config_filled_in`: whether the DeepSpeed strategy has filled its config in.
- `forget_step_metrics`: a metric a training step does not log is not written with its last value.
- `cluster_environment`: the trainer's cluster environment, which decides whether SLURM's requeue is handled.
- `spawns_processes`: whether the strategy starts its processes by pickling the trainer (`ddp_spawn`).
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.connectors.data_connector import (
    _parse_num_batches,
    _process_dataloader,
    _request_dataloader,
)
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.combined_loader import _SUPPORTED_MODES
from lightning.pytorch.utilities.data import has_len_all_ranks

# The Lightning releases whose private API this module was checked against: [low, high).
CHECKED_VERSIONS = ("2.6.4", "2.7")
# The release read line by line for the comments below.
CHECKED_AGAINST = "2.6.6"


class ModelCheckpointHooks(ModelCheckpoint):
    """Lightning's `ModelCheckpoint` (same arguments) whose private save, "last" lookup, link and removal call
    hooks with public names, which do what Lightning does until a subclass overrides them.

    Checked against Lightning 2.6.6, where every save of a `ModelCheckpoint` goes through `_save_checkpoint`
    (on every rank: top-k, last, on exception), `ckpt_path="last"` asks each one's `_find_last_checkpoints`,
    `save_last="link"` links through `_link_checkpoint` and a superseded checkpoint goes through
    `_remove_checkpoint`.
    """

    # ---------------------------------------------------------------- hooks (a subclass overrides these)
    def before_save(self, trainer, filepath: str) -> None:
        """Runs on every rank before each save of this callback, before `trainer.save_checkpoint`."""

    def after_save(self, trainer, filepath: str) -> None:
        """Runs on every rank after each save, once `trainer.save_checkpoint` has passed its barrier."""

    def find_last_checkpoints(self, trainer) -> set[str] | None:
        """What `ckpt_path="last"` may resolve to (Lightning takes the newest by mtime over every
        `ModelCheckpoint`'s); None leaves it to Lightning's lookup of `last*.ckpt` in `dirpath`."""
        return None

    def link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:
        """Points `linkpath` at `filepath` (`save_last="link"`); called on every rank, as Lightning's is."""
        ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)

    def before_remove(self, trainer, filepath: str) -> None:
        """Runs on every rank before a superseded checkpoint (top-k or last) is removed."""

    # ----------------------------------------------------------- the private methods, routed to the hooks
    def _save_checkpoint(self, trainer, filepath: str) -> None:
        # Lightning 2.6.6: `_save_checkpoint(self, trainer, filepath)` calls `trainer.save_checkpoint` (whose
        # barrier every rank passes) and records `_last_checkpoint_saved`; every save path calls it.
        self.before_save(trainer, filepath)
        super()._save_checkpoint(trainer, filepath)
        self.after_save(trainer, filepath)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        # Lightning 2.6.6: `_CheckpointConnector._parse_ckpt_path` resolves ckpt_path="last" to the newest, by
        # mtime, of what each ModelCheckpoint's `_find_last_checkpoints(trainer)` returns, without looking
        # inside.
        found = self.find_last_checkpoints(trainer)
        return super()._find_last_checkpoints(trainer) if found is None else found

    def _link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        # Lightning 2.6.6: a staticmethod `_link_checkpoint(trainer, filepath, linkpath)`, called only as
        # `self._link_checkpoint(trainer, self._last_checkpoint_saved, filepath)` in `_save_last_checkpoint`,
        # so an instance method receives the same arguments.
        self.link_checkpoint(trainer, filepath, linkpath)

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        # Lightning 2.6.6: `_remove_checkpoint(self, trainer, filepath)` removes a superseded top-k or last
        # checkpoint (`trainer.strategy.remove_checkpoint`) after the save that supersedes it.
        self.before_remove(trainer, filepath)
        super()._remove_checkpoint(trainer, filepath)

    # -------------------------------------------------------- private helpers and state, under public names
    def skips_saving(self, trainer) -> bool:
        """Lightning's test before a save in a training hook: true in a sanity check or `fast_dev_run`,
        outside fitting, and when this step is saved already (2.6.6: `_should_skip_saving_checkpoint`)."""
        return self._should_skip_saving_checkpoint(trainer)

    def monitor_candidates(self, trainer) -> dict[str, Any]:
        """The metrics a checkpoint name and the monitor read, with `epoch` and `step` (2.6.6:
        `_monitor_candidates`)."""
        return self._monitor_candidates(trainer)

    def save_topk_and_last(self, trainer, monitor_candidates: dict[str, Any]) -> None:
        """The save `on_train_batch_end` makes: top-k, then last (2.6.6: `_save_topk_checkpoint`,
        `_save_last_checkpoint`)."""
        self._save_topk_checkpoint(trainer, monitor_candidates)
        self._save_last_checkpoint(trainer, monitor_candidates)

    @property
    def last_checkpoint_saved(self) -> str:
        """The path of this callback's newest save, "" before any (2.6.6: `_last_checkpoint_saved`)."""
        return self._last_checkpoint_saved

    @property
    def last_global_step_saved(self) -> int:
        """The global step of this callback's newest save (2.6.6: `_last_global_step_saved`)."""
        return self._last_global_step_saved


# Lightning 2.6.6's fit-loop state in a checkpoint: checkpoint["loops"]["fit_loop"] holds these entries; each
# progress has "total" and "current" counts of _KEYS, the batch progress also "is_last_batch", and the epoch
# loop's state dict `_batches_that_stepped`.
_FIT = "fit_loop"
_EPOCHS = "epoch_progress"
_BATCHES = "epoch_loop.batch_progress"
_VAL_BATCHES = "epoch_loop.val_loop.batch_progress"
_LOOP_STATE = "epoch_loop.state_dict"
_KEYS = ("ready", "started", "processed", "completed")


def resumable_fit_progress(checkpoint: dict[str, Any]) -> str | None:
    """Rewrites, in place, the fit-loop progress of a checkpoint saved after a training batch into the form
    Lightning resumes exactly from (see `exgrpo_pl.checkpoints.resume`); other checkpoints are left alone.

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
        # The uninterrupted run zeroes the validation batches counted in the epoch when the next one starts;
        # Lightning, resuming, takes that start for a restart and keeps them.
        if _VAL_BATCHES in loop:
            loop[_VAL_BATCHES]["total"].update(dict.fromkeys(_KEYS, 0))
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
    # Lightning 2.6.6: the restored epoch loop's `restarting` / `restarted_on_last`, the fit loop's
    # `_data_fetcher`, and `_should_check_val_fx(data_fetcher)`, its own test in TrainingEpochLoop.advance.
    if loop._should_check_val_fx(fetcher):
        loop._batches_that_stepped -= 1


def _set(progress: dict[str, Any], total: dict[str, int]) -> None:
    """Sets the total counts to `total` and the current ones (this run's) to as much less as they were."""
    shift = {k: progress["current"][k] - progress["total"][k] for k in _KEYS}
    progress["total"].update(total)
    progress["current"].update({k: total[k] + shift[k] for k in _KEYS})


# Lightning 2.6.6: `_FitLoop.setup_data` requests the training loader from `fit_loop._data_source`
# (`_request_dataloader`), wraps it in a CombinedLoader, prepares each (`_process_dataloader`: distributed
# sampler), limits each (`_parse_num_batches`) and takes the CombinedLoader's length from its mode
# (`_SUPPORTED_MODES[mode]["fn"]`, `CombinedLoader._mode`); this repeats it without setting anything up.
def training_batches(trainer) -> int | float:
    """What `trainer.num_training_batches` will be, measured as `FitLoop.setup_data` measures it."""
    requested = _request_dataloader(trainer.fit_loop._data_source)
    combined = (
        requested if isinstance(requested, CombinedLoader) else CombinedLoader(requested, "max_size_cycle")
    )
    allow_zero = trainer.lightning_module.allow_zero_length_dataloader_with_multiple_devices
    if trainer.datamodule is not None:
        allow_zero |= trainer.datamodule.allow_zero_length_dataloader_with_multiple_devices
    stage, limits = RunningStage.TRAINING, []
    for loader in combined.flattened:
        loader = _process_dataloader(trainer, TrainerFn.FITTING, stage, loader)
        length = len(loader) if has_len_all_ranks(loader, trainer.strategy, allow_zero) else math.inf
        limits.append(_parse_num_batches(stage, length, trainer.limit_train_batches))
    return _SUPPORTED_MODES[combined._mode]["fn"](limits)  # a CombinedLoader's length, from its limits


def loader_states_pending(trainer) -> bool:
    """Whether the checkpoint's training loader states are still waiting to be loaded into a loader
    (Lightning 2.6.6: `fit_loop._combined_loader_states_to_load`, cleared once loaded)."""
    return bool(trainer.fit_loop._combined_loader_states_to_load)


def batches_that_stepped(trainer) -> int:
    """The batches counted as stepped, Lightning's logging step (2.6.6:
    `epoch_loop._batches_that_stepped`)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def should_update_logs(trainer) -> bool:
    """Whether this step is a logging step, the test Lightning's `LearningRateMonitor` makes (2.6.6:
    `trainer._logger_connector.should_update_logs`)."""
    return trainer._logger_connector.should_update_logs


def attached_trainer(module) -> Any:
    """The module's trainer, or None when it has none (outside a fit, in `load_from_checkpoint`), where the
    public `LightningModule.trainer` raises (2.6.6: the attribute `_trainer`)."""
    return getattr(module, "_trainer", None)


def deepspeed_config_filled_in(strategy) -> bool:
    """Whether Lightning's DeepSpeed strategy has filled its config in from the trainer; False for any other
    strategy (2.6.6: `DeepSpeedStrategy._config_initialized`, set once `_format_config` has run)."""
    return getattr(strategy, "_config_initialized", False)


def spawns_processes(strategy) -> bool:
    """Whether the strategy starts its processes in new interpreters that unpickle the trainer, module and
    data (`ddp_spawn`; 2.6.6: a `_MultiProcessingLauncher` whose `_start_method` is not "fork")."""
    launcher = getattr(strategy, "launcher", None)
    return isinstance(launcher, _MultiProcessingLauncher) and launcher._start_method != "fork"


def cluster_environment(trainer) -> Any:
    """The cluster environment the trainer detected or was given, for every strategy (a single-device one
    has none of its own, yet Lightning's signal handlers read it; 2.6.6:
    `trainer._accelerator_connector.cluster_environment`)."""
    return trainer._accelerator_connector.cluster_environment


def forget_step_metrics(trainer, fx: str, names) -> None:
    """Leaves `names`, logged from hook `fx` on an earlier step, out of what this step writes: Lightning keeps
    every metric logged in the epoch and writes each, with its last value, at every logging step until the
    epoch ends, so a metric a step does not log would repeat the last step's (2.6.6: `trainer._results`,
    keyed "<fx>.<name>", writes only entries whose `has_reset` is False, set again when the name is logged).

    Args:
        trainer: the running trainer.
        fx: the hook the names were logged from (`on_train_batch_end`).
        names: the metric names not logged on this step.
    """
    results = trainer._results
    for name in names:
        metric = results.get(f"{fx}.{name}") if results is not None else None
        if metric is not None:
            metric.has_reset = True

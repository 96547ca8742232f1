"""Checkpoints that a kill cannot corrupt, and a `ckpt_path="last"` that resumes from a complete one.

    Trainer(plugins=[AtomicCheckpointIO()], callbacks=[SafeModelCheckpoint(save_last="link")])
    trainer.fit(module, datamodule, ckpt_path="last")

`AtomicCheckpointIO` writes each checkpoint file under a temp name next to its final path and renames it into
place, so a checkpoint's name only ever holds a complete file, wherever `$TMPDIR` is; it refuses to write
non-finite weights. `SafeModelCheckpoint` saves when training ends, whatever stopped it, resolves "last" to
the newest complete checkpoint and moves `last.ckpt` links atomically. `exgrpo fit` installs both by default.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pickle
import shutil
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from exgrpo_pl.checkpoints.atomic_writes import (
    COMPLETE_MARKER,
    TEMP_NAME,
    OutOfSpaceError,
    link_atomically,
    local_path,
    mark_complete,
    mark_incomplete,
    raise_if_out_of_space,
    remove_stale_temp_files,
    save_atomically,
    temp_path,
    tensor_bytes,
    write_files_atomically,
)
from exgrpo_pl.checkpoints.integrity import (
    NonFiniteCheckpointError,
    NonFiniteWeightsError,
    NotALightningCheckpointError,
    check_finite,
    check_lightning_checkpoint,
    check_loadable,
    check_restored_finite,
    first_non_finite,
    held_parameters,
    incomplete_reason,
    newest_complete_checkpoint,
)
from exgrpo_pl.checkpoints.requeue import check_same_resume
from exgrpo_pl.lightning_internals import ModelCheckpointHooks

__all__ = [
    "COMPLETE_MARKER",
    "TEMP_NAME",
    "AtomicCheckpointIO",
    "NonFiniteCheckpointError",
    "NonFiniteWeightsError",
    "NotALightningCheckpointError",
    "OutOfSpaceError",
    "SafeModelCheckpoint",
    "UnsafeCheckpointError",
    "check_finite",
    "check_lightning_checkpoint",
    "check_loadable",
    "check_restored_finite",
    "first_non_finite",
    "held_parameters",
    "incomplete_reason",
    "link_atomically",
    "mark_complete",
    "newest_complete_checkpoint",
    "raise_if_out_of_space",
    "remove_stale_temp_files",
    "save_atomically",
    "temp_path",
    "tensor_bytes",
    "write_files_atomically",
]


class UnsafeCheckpointError(ValueError):
    """A checkpoint's pickle names something other than tensors and primitives; nothing of it was run."""


def _unpickler_reason(err: Exception) -> str:
    """The line of torch's long weights-only refusal that says what was refused."""
    lines = [line.strip() for line in str(err).splitlines()]
    return next((line for line in lines if "Unpickler error" in line), lines[0] if lines else "")


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO`, writing local checkpoints with `save_atomically`.

    Lightning's own writer copies a temp file from `$TMPDIR` onto the final name, and when `$TMPDIR` is on
    another filesystem that copy can be cut short. Remote URLs still go through Lightning's writer. A
    checkpoint whose `state_dict` holds NaN or inf is refused (`NonFiniteCheckpointError`) before anything is
    written.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Writes `checkpoint` to `path` atomically.

        Args:
            checkpoint: what `Trainer.save_checkpoint` dumped.
            path: the final file path.
            storage_options: not supported, as in `TorchCheckpointIO`.
        """
        check_finite(checkpoint.get("state_dict", {}), path)
        local = local_path(path)
        if local is None or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
        else:
            save_atomically(checkpoint, local)

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only=None):
        """`TorchCheckpointIO.load_checkpoint`, unpickling tensors and primitives only, local file or URL.

        Lightning loads a URL with `weights_only=False` unless told otherwise, which runs whatever code the
        file's pickle names; here `weights_only=None` means True everywhere (only an explicit False, given
        to `Trainer.fit(weights_only=False)` for a trusted file, allows more, and runs the code the file
        names). A local file is checked first (`incomplete_reason`: complete, every record passing its
        CRC-32), and an incomplete or corrupt one is an error naming it and the record. A plain `state_dict`
        loads as it is: Lightning's spawn launcher passes one back through here (`exgrpo fit --ckpt_path`
        refuses one before anything is built, `check_loadable`).
        """
        weights_only = True if weights_only is None else weights_only
        local = local_path(path)
        reason = incomplete_reason(local) if local is not None and os.path.exists(local) else None
        if reason is not None:
            raise RuntimeError(
                f"Checkpoint {path} cannot be resumed from ({reason}). Resume from another checkpoint, or"
                ' with ckpt_path="last" and SafeModelCheckpoint, which skips incomplete and corrupt ones.'
            )
        try:
            checkpoint = super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"Refusing to load checkpoint {path}: it holds objects other than tensors and primitive"
                " containers, and unpickling them could run code. `weights_only=False` (`--weights_only"
                " false`) unpickles them, running whatever code the file names: give it only for a file"
                f" you made yourself or trust as you would a program. ({_unpickler_reason(err)})"
            ) from err
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Removes a checkpoint file, link or (DeepSpeed) folder; a folder is renamed away first, so it is
        whole or gone, never half-deleted.

        Args:
            path: the checkpoint to remove.
        """
        local = local_path(path)
        if local is None:
            super().remove_checkpoint(path)
        elif os.path.isdir(local) and not os.path.islink(local):
            doomed = temp_path(local)
            os.replace(local, doomed)
            shutil.rmtree(doomed)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(local)


class SafeModelCheckpoint(ModelCheckpointHooks):
    """Lightning's `ModelCheckpoint` (same arguments) that a kill or an early stop cannot defeat.

    - Saves when training ends, whatever stopped it (max_steps mid-epoch, max_epochs, a callback's
      `should_stop`), unless that step is saved already. Lightning saves at train end only `last.ckpt`, only
      with `save_last` set and only if the run saved nothing at all.
    - `ckpt_path="last"` resumes from the newest complete `*.ckpt` in its directory, skipping (with a
      warning) truncated files and dangling links. Without a `dirpath`, it looks in every version of the
      logger's run (`<save_dir>/<name>/*/checkpoints`): each fit gets a new version folder, so Lightning's
      own lookup, in the new, empty one, never finds the previous run's checkpoints.
    - `save_last="link"` moves `last.ckpt` by renaming a new link over it, and onto a new checkpoint before
      the previous one is removed: it never goes missing or dangles.
    - Clears the temp files of killed saves from those directories at setup.
    - Marks a DeepSpeed checkpoint folder complete (`COMPLETE_MARKER`) once every rank has written its part.
    - Stops every rank at setup when the ranks resolved "last" to different checkpoints (nodes that do not
      share the checkpoint folder), naming each rank's (`check_same_resume`), where they would hang.

    Lightning's public callback hooks do the first two and the setup; the rest are hooks of
    `exgrpo_pl.lightning_internals.ModelCheckpointHooks`, which holds the overrides of Lightning's private
    methods they need.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._logger_dirs = self.dirpath is None
        self._step_began = False  # whether a training step of this fit has begun (for `on_exception`)
        self._resolved_last: tuple[str | None, list[str] | None] | None = None  # "last" of this fit, if asked

    def _checkpoint_dirs(self, trainer) -> list[str] | None:
        """Where this callback's checkpoints are (all logger versions without a dirpath); None when remote."""
        if not self._logger_dirs:
            return [self.dirpath] if local_path(self.dirpath) is not None else None
        if not trainer.loggers:
            root, pattern = trainer.default_root_dir, "checkpoints"
        else:
            logger = trainer.loggers[0]
            root = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
            pattern = os.path.join(glob.escape(str(logger.name)), "*", "checkpoints")
        if local_path(root) is None:
            return None
        return sorted(glob.glob(os.path.join(glob.escape(str(root)), pattern)))

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._step_began = False
        if self._resolved_last is not None:  # resolved by this fit, before the ranks could compare
            resolved, self._resolved_last = self._resolved_last, None
            check_same_resume(*resolved)
        if trainer.is_global_zero:
            for directory in {self.dirpath, *(self._checkpoint_dirs(trainer) or [])}:
                if local_path(directory) is not None:
                    remove_stale_temp_files(directory)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        # The same save `on_train_batch_end` makes; skipped when this step has been saved already, or in a
        # sanity check / fast_dev_run.
        if not self.skips_saving(trainer):
            metrics = self.monitor_candidates(trainer)
            # By now Lightning has counted the last epoch, cut short or not, as done, so `current_epoch` is
            # one past the epoch the last step was in: name the checkpoint after that one.
            metrics["epoch"] = torch.tensor(max(trainer.current_epoch - 1, 0))
            self.save_topk_and_last(trainer, metrics)
        super().on_train_end(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        self._step_began = True
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning's `save_on_exception=True` saves the state as the exception left it; by default nothing
        # is saved, and this says why and what is kept. An exception before the first step (bad data or
        # options in setup, a checkpoint refused on loading) leaves nothing half done: its message is all.
        if self.save_on_exception or trainer.state.fn != TrainerFn.FITTING:
            super().on_exception(trainer, pl_module, exception)
            return
        if not self._step_began:
            return
        if self.last_checkpoint_saved:
            step = self.last_global_step_saved
            lost = trainer.global_step - step
            redo = f", redoing the {lost} finished steps after it" if lost else ""
            kept = (
                f"The newest checkpoint of this run, {self.last_checkpoint_saved} (step {step}), is"
                f' untouched: resuming from it (`ckpt_path="last"`) continues from step {step}{redo}.'
            )
        else:
            kept = "This run saved no checkpoint before it; older checkpoints are untouched."
        rank_zero_warn(
            f"Training stopped at step {trainer.global_step} by {type(exception).__name__}, and no checkpoint"
            " is saved on the way out: an exception can stop a step halfway (its batch drawn, the generators"
            " advanced, the weights possibly updated), and a resume from such a state would not continue the"
            f" run exactly. {kept}"
        )

    @override
    def before_save(self, trainer, filepath: str) -> None:
        """Refuses non-finite weights on every rank, and marks a DeepSpeed folder saved into again incomplete.

        Every rank saves, and only rank 0 writes, so only rank 0's writer would refuse non-finite weights
        while the other ranks wait for it in the save's barrier. Deciding on every rank first makes them all
        raise together, each over what it holds (nothing is gathered).
        """
        weights = held_parameters(trainer.lightning_module)
        if not trainer.strategy.reduce_boolean_decision(first_non_finite(weights) is None, all=True):
            check_finite(weights, filepath)  # raises naming the parameter on the ranks that hold it
            raise NonFiniteCheckpointError(
                f"Refusing to write checkpoint {filepath}: another rank's weights hold NaN or inf. Existing"
                " checkpoints are untouched; resume from the newest one."
            )
        local = local_path(filepath)
        if trainer.is_global_zero and local is not None and os.path.isdir(local):
            # A save into an existing folder (save_last: true) makes it incomplete until the marker is back;
            # DeepSpeed lets no rank write before the barrier that opens its save.
            mark_incomplete(local)

    @override
    def after_save(self, trainer, filepath: str) -> None:
        """Marks a DeepSpeed checkpoint folder complete: `Trainer.save_checkpoint` has passed its barrier,
        so every rank's shards are written."""
        local = local_path(filepath)
        if trainer.is_global_zero and local is not None and os.path.isdir(local):
            mark_complete(local)

    @override
    def find_last_checkpoints(self, trainer) -> set[str] | None:
        """The newest complete checkpoint in this callback's directories (none when there is none); None, for
        Lightning's lookup, when they are remote."""
        directories = self._checkpoint_dirs(trainer)
        if directories is None:
            return None
        newest = newest_complete_checkpoint(directories)
        self._resolved_last = (newest, directories)
        return {newest} if newest is not None else set()

    @override
    def link_checkpoint(self, trainer, filepath: str, linkpath: str) -> None:
        """Renames a new link over `linkpath`: Lightning deletes `linkpath` and then creates the link, and a
        kill in between leaves none."""
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                shutil.rmtree(linkpath)  # a real folder (DeepSpeed, save_last=True before): no rename over it
            link_atomically(filepath, linkpath)
        trainer.strategy.barrier()

    @override
    def before_remove(self, trainer, filepath: str) -> None:
        """With save_last="link", points the link at the newest save before the checkpoint it pointed at is
        removed (Lightning removes the previous top-k checkpoint first, which takes seconds for a DeepSpeed
        folder). Decided from bookkeeping only, so every rank reaches the link's barrier alike."""
        newest, link = self.last_checkpoint_saved, self.last_model_path
        if self.save_last == "link" and link and newest and filepath not in (newest, link) and newest != link:
            self.link_checkpoint(trainer, newest, link)

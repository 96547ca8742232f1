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
import errno
import glob
import os
import pickle
import re
import secrets
import shutil
import zipfile
from typing import Any

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

# `.<final name>.tmp-<pid>-<8 hex>`: a dot file, so no "*.ckpt" glob and no "last" lookup ever matches it.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")
# Written into a DeepSpeed checkpoint folder once every rank has written its part (`mark_complete`).
COMPLETE_MARKER = "exgrpo-complete"


class NonFiniteCheckpointError(ValueError):
    """A checkpoint's weights hold NaN or inf; nothing was written."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint's pickle names something other than tensors and primitives; nothing of it was run."""


def _local(path: Any) -> str | None:
    """`path` as a local filesystem path, or None for a remote URL (left to Lightning's writer)."""
    fs, local = url_to_fs(str(path))
    return local if isinstance(fs, LocalFileSystem) else None


def _unpickler_reason(err: Exception) -> str:
    """The line of torch's long weights-only refusal that says what was refused."""
    lines = [line.strip() for line in str(err).splitlines()]
    return next((line for line in lines if "Unpickler error" in line), lines[0] if lines else "")


def temp_path(path: str) -> str:
    """A fresh name in the same directory as `path` that `remove_stale_temp_files` recognises.

    Args:
        path: the final path the temp file stands in for.
    """
    directory, name = os.path.split(path)
    return os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the rename itself durable, not only the file's bytes
    finally:
        os.close(fd)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process saves synchronously: a temp file of its own is from an earlier failure
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def remove_stale_temp_files(directory: str) -> list[str]:
    """Deletes the temp files (and folders being removed) that killed saves left in `directory`.

    Only names in the temp pattern are touched; those of a process still running on this machine are kept,
    since it may be saving right now.

    Args:
        directory: a checkpoint directory; a missing one is fine.

    Returns:
        The deleted paths.
    """
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    stale = []
    for name in names:
        match = TEMP_NAME.match(name)
        if match is not None and not _process_alive(int(match["pid"])):
            stale.append(os.path.join(directory, name))
            _delete(stale[-1])
    return stale


def save_atomically(checkpoint: dict[str, Any], path: str) -> None:
    """`torch.save` into a temp file next to `path`, fsync it, rename it over `path`, fsync the directory.

    A kill at any moment leaves either the old `path` or the new one, plus at most a temp file, which the
    next save into that directory deletes. Stale temp files are deleted first.

    Args:
        checkpoint: what to save.
        path: the final local path.

    Raises:
        OutOfSpaceError: the filesystem filled up (the temp file is deleted, `path` untouched).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    remove_stale_temp_files(directory)
    temp = temp_path(path)
    try:
        with open(temp, "xb") as file:  # unlike mkstemp's 0600, the checkpoint gets the umask's mode
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        raise_if_out_of_space(err, path, tensor_bytes(checkpoint))
        raise
    _fsync_directory(directory)


class OutOfSpaceError(OSError):
    """A write found its filesystem full; the message names the path, the space needed and the space free."""


def tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in `value` (nested dicts, lists and tuples): what its file takes at least."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def raise_if_out_of_space(err: BaseException, path: str, needed_bytes: int) -> None:
    """Raises `OutOfSpaceError` from `err` when it, or an error it arose from, says the disk or quota is full.

    torch's writer turns the `OSError` of a full disk into a bare `RuntimeError` ("unexpected pos"), which
    keeps the OSError as its context; that chain is what is read here.

    Args:
        err: the error a write raised.
        path: what was being written.
        needed_bytes: what the write needs at least.
    """
    cause, seen = err, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
            raise OutOfSpaceError(
                errno.ENOSPC,
                f"No space left to write {path}: it needs at least {needed_bytes / 2**20:.1f} MiB and"
                f" {free / 2**20:.1f} MiB is free there ({cause.strerror}). Nothing was written and existing"
                " checkpoints are untouched; free some space, or save elsewhere (the checkpoint callback's"
                " `dirpath`, `trainer.default_root_dir`).",
            ) from err
        cause = cause.__cause__ or cause.__context__


def link_atomically(target: str, link: str) -> None:
    """Points the symlink `link` at `target` (relative) by renaming a new link over it: never missing.

    Args:
        target: the checkpoint to point at.
        link: the link's path (e.g. last.ckpt), replaced if it exists.
    """
    temp = temp_path(link)
    os.symlink(os.path.relpath(target, os.path.dirname(os.path.abspath(link))), temp)
    os.replace(temp, link)
    _fsync_directory(os.path.dirname(os.path.abspath(link)))


def mark_complete(folder: str) -> None:
    """Writes `COMPLETE_MARKER` into a checkpoint folder (temp file, rename, fsync): call it once every rank
    has finished writing into the folder.

    Args:
        folder: a local DeepSpeed checkpoint folder.
    """
    marker = os.path.join(folder, COMPLETE_MARKER)
    temp = temp_path(marker)
    try:
        with open(temp, "x") as file:
            file.write("every rank's shards are written\n")
            file.flush()
            os.fsync(file.fileno())
    except OSError as err:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        raise_if_out_of_space(err, marker, 32)
        raise
    os.replace(temp, marker)
    _fsync_directory(folder)


def first_non_finite(tensors: dict[str, Any]) -> str | None:
    """The name of the first floating, non-empty tensor holding NaN or inf; None when all are finite.

    `aminmax` is NaN when any element is NaN and +-inf when one is infinite, so two scalars per tensor
    answer for all of it without a tensor-sized mask (which on a GPU near its memory limit could OOM).

    Args:
        tensors: name -> tensor; other values are skipped.
    """
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel():
            low, high = torch.aminmax(tensor.detach())
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                return name
    return None


def held_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> the values of each parameter this process holds: the parameter itself, or under DeepSpeed
    ZeRO-3, whose parameters are empty placeholders between forwards, this rank's partition (`ds_tensor`).

    Args:
        module: the (possibly sharded) module.
    """
    return {
        name: parameter if getattr(parameter, "ds_tensor", None) is None else parameter.ds_tensor
        for name, parameter in module.named_parameters()
    }


def check_finite(state_dict: dict[str, Any], path: Any) -> None:
    """Raises `NonFiniteCheckpointError` naming `path` and the first parameter holding NaN or inf.

    Args:
        state_dict: name -> tensor; non-floating and empty tensors are skipped.
        path: the checkpoint being written, for the message.
    """
    name = first_non_finite(state_dict)
    if name is not None:
        tensor = state_dict[name]
        nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
        raise NonFiniteCheckpointError(
            f"Refusing to write checkpoint {path}: parameter {name!r} has {nan} NaN and {inf} inf values"
            f" out of {tensor.numel()}. Existing checkpoints are untouched; resume from the newest one."
        )


def incomplete_reason(path: str) -> str | None:
    """Why `path` cannot be resumed from, or None when it is a complete checkpoint.

    A file is complete when its zip index (written last by `torch.save`) is there and its pickle record
    passes its CRC: this reads the index and the pickle, never the tensors, whatever their size, and
    unpickles nothing. A DeepSpeed checkpoint folder is complete once it holds `COMPLETE_MARKER`: DeepSpeed's
    own `latest` file is written by rank 0 alone, before the barrier that waits for the other ranks' shards.

    Args:
        path: a checkpoint file, link or folder.
    """
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            return None
        return f"no {COMPLETE_MARKER} file in the folder: a rank may not have finished writing its shards"
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("data.pkl")]
            if not pickles:
                return "no data.pkl record"
            archive.read(pickles[0])
    except Exception as err:  # empty, truncated, dangling link, bad CRC: all mean "cannot resume from this"
        return f"{type(err).__name__}: {err}"
    return None


def check_loadable(path: Any, option: str = "ckpt_path") -> None:
    """Raises ValueError naming `option` and `path` when `path` is a local file that is not a complete
    checkpoint (empty, truncated, not a zip), instead of torch's bare `EOFError` or zip error.

    Args:
        path: the checkpoint given; URLs, "last" and other non-files are left to the loader.
        option: the option it came from, for the message.
    """
    local = _local(path) if path is not None else None
    if local is None or not os.path.isfile(local):
        return
    reason = incomplete_reason(local)
    if reason is not None:
        raise ValueError(
            f"{option}={path}: not a complete checkpoint ({reason}); a save into it was cut short, or it is"
            " not a checkpoint. Give another one, or `last`, which takes the newest complete checkpoint."
        )


def _saved_at(path: str) -> int:
    """When `path` was saved: its mtime; a DeepSpeed folder's is its completion marker's (removing files from
    an older folder touches the folder's own mtime); a dangling link's is the link's own."""
    with contextlib.suppress(OSError):
        return os.stat(os.path.join(path, COMPLETE_MARKER) if os.path.isdir(path) else path).st_mtime_ns
    with contextlib.suppress(OSError):
        return os.lstat(path).st_mtime_ns
    return -1


def newest_complete_checkpoint(directories: list[str]) -> str | None:
    """The newest complete `*.ckpt` in `directories`, warning about each newer one that is incomplete.

    Args:
        directories: checkpoint directories; missing ones are skipped.

    Returns:
        A path, or None when there is no complete checkpoint.
    """
    paths = []
    for directory in directories:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            names = os.listdir(directory)
            paths += [os.path.join(directory, n) for n in names if n.endswith(".ckpt") and n[0] != "."]
    skipped, seen = [], set()
    # Newest first; a link after the file it points to (same mtime), so warnings name the file itself.
    for path in sorted(paths, key=lambda p: (_saved_at(p), not os.path.islink(p)), reverse=True):
        if os.path.realpath(path) in seen:
            continue  # last.ckpt linked to a checkpoint already judged
        seen.add(os.path.realpath(path))
        reason = incomplete_reason(path)
        if reason is None:
            for bad, why in skipped:
                rank_zero_warn(f'ckpt_path="last": skipping incomplete {bad} ({why}); using {path}')
            return path
        skipped.append((path, reason))
    if skipped:
        listing = "; ".join(f"{bad} ({why})" for bad, why in skipped)
        rank_zero_warn(f'ckpt_path="last": no complete checkpoint, so none is loaded. Incomplete: {listing}')
    return None


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
        local = _local(path)
        if local is None or storage_options is not None:
            super().save_checkpoint(checkpoint, path, storage_options)
        else:
            save_atomically(checkpoint, local)

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only=None):
        """`TorchCheckpointIO.load_checkpoint`, unpickling tensors and primitives only, local file or URL.

        Lightning loads a URL with `weights_only=False` unless told otherwise, which runs whatever code the
        file's pickle names; here `weights_only=None` means True everywhere (only an explicit False, given
        to `Trainer.fit(weights_only=False)` for a trusted file, allows more). An incomplete file's error
        names it and says what happened.
        """
        weights_only = True if weights_only is None else weights_only
        try:
            return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except FileNotFoundError:
            raise
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"Refusing to load checkpoint {path}: it holds objects other than tensors and primitive"
                " containers, and unpickling them could run code. Load it with `weights_only=False` only if"
                f" you trust its source. ({_unpickler_reason(err)})"
            ) from err
        except Exception as err:
            local = _local(path)
            reason = incomplete_reason(local) if local is not None else None
            if reason is None:
                raise
            raise RuntimeError(
                f"Checkpoint {path} is incomplete ({reason}): a save into it was cut short. Resume from"
                ' another checkpoint, or with ckpt_path="last" and SafeModelCheckpoint, which skips those.'
            ) from err

    def remove_checkpoint(self, path: Any) -> None:
        """Removes a checkpoint file, link or (DeepSpeed) folder; a folder is renamed away first, so it is
        whole or gone, never half-deleted.

        Args:
            path: the checkpoint to remove.
        """
        local = _local(path)
        if local is None:
            super().remove_checkpoint(path)
        elif os.path.isdir(local) and not os.path.islink(local):
            doomed = temp_path(local)
            os.replace(local, doomed)
            shutil.rmtree(doomed)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(local)


class SafeModelCheckpoint(ModelCheckpoint):
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

    The overrides of Lightning's private methods are each commented; tests/test_checkpointing.py pins their
    names and signatures.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._logger_dirs = self.dirpath is None

    def _checkpoint_dirs(self, trainer) -> list[str] | None:
        """Where this callback's checkpoints are (all logger versions without a dirpath); None when remote."""
        if not self._logger_dirs:
            return [self.dirpath] if _local(self.dirpath) is not None else None
        if not trainer.loggers:
            root, pattern = trainer.default_root_dir, "checkpoints"
        else:
            logger = trainer.loggers[0]
            root = logger.save_dir if logger.save_dir is not None else trainer.default_root_dir
            pattern = os.path.join(glob.escape(str(logger.name)), "*", "checkpoints")
        if _local(root) is None:
            return None
        return sorted(glob.glob(os.path.join(glob.escape(str(root)), pattern)))

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero:
            for directory in {self.dirpath, *(self._checkpoint_dirs(trainer) or [])}:
                if _local(directory) is not None:
                    remove_stale_temp_files(directory)

    def on_train_end(self, trainer, pl_module) -> None:
        # Private helpers: the same save `on_train_batch_end` makes; the skip check is false when this step
        # has been saved already, or in a sanity check / fast_dev_run.
        if not self._should_skip_saving_checkpoint(trainer):
            metrics = self._monitor_candidates(trainer)
            # By now Lightning has counted the last epoch, cut short or not, as done, so `current_epoch` is
            # one past the epoch the last step was in: name the checkpoint after that one.
            metrics["epoch"] = torch.tensor(max(trainer.current_epoch - 1, 0))
            self._save_topk_checkpoint(trainer, metrics)
            self._save_last_checkpoint(trainer, metrics)
        super().on_train_end(trainer, pl_module)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # Lightning's `save_on_exception=True` saves the state as the exception left it; by default nothing
        # is saved, and this says why and what is kept.
        if self.save_on_exception or trainer.state.fn != TrainerFn.FITTING:
            super().on_exception(trainer, pl_module, exception)
            return
        if self._last_checkpoint_saved:
            step = self._last_global_step_saved
            lost = trainer.global_step - step
            redo = f", redoing the {lost} finished steps after it" if lost else ""
            kept = (
                f"The newest checkpoint of this run, {self._last_checkpoint_saved} (step {step}), is"
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

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        # Private: every rank calls it for each save, and only rank 0 writes, so only rank 0's writer would
        # refuse non-finite weights while the other ranks wait for it in the save's barrier. Deciding on
        # every rank first makes them all raise together, each over what it holds (nothing is gathered).
        weights = held_parameters(trainer.lightning_module)
        if not trainer.strategy.reduce_boolean_decision(first_non_finite(weights) is None, all=True):
            check_finite(weights, filepath)  # raises naming the parameter on the ranks that hold it
            raise NonFiniteCheckpointError(
                f"Refusing to write checkpoint {filepath}: another rank's weights hold NaN or inf. Existing"
                " checkpoints are untouched; resume from the newest one."
            )
        local = _local(filepath)
        if trainer.is_global_zero and local is not None and os.path.isdir(local):
            # A save into an existing folder (save_last: true) makes it incomplete until the marker is back;
            # DeepSpeed lets no rank write before the barrier that opens its save.
            _delete(os.path.join(local, COMPLETE_MARKER))
        super()._save_checkpoint(trainer, filepath)
        # Trainer.save_checkpoint has passed its barrier: every rank's DeepSpeed shards are written.
        if trainer.is_global_zero and local is not None and os.path.isdir(local):
            mark_complete(local)

    def _find_last_checkpoints(self, trainer) -> set[str]:
        # Private: Lightning's `_CheckpointConnector._parse_ckpt_path` resolves ckpt_path="last" to the
        # newest, by mtime, of what each ModelCheckpoint returns here, without looking inside.
        directories = self._checkpoint_dirs(trainer)
        if directories is None:
            return super()._find_last_checkpoints(trainer)
        newest = newest_complete_checkpoint(directories)
        return {newest} if newest is not None else set()

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        # Private: Lightning deletes `linkpath` and then creates the link; a kill in between leaves none.
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            if os.path.isdir(linkpath) and not os.path.islink(linkpath):
                shutil.rmtree(linkpath)  # a real folder (DeepSpeed, save_last=True before): no rename over it
            link_atomically(filepath, linkpath)
        trainer.strategy.barrier()

    def _remove_checkpoint(self, trainer, filepath: str) -> None:
        # Private: with save_last="link", Lightning removes the previous top-k checkpoint before it moves
        # last.ckpt off it (seconds for a DeepSpeed folder); point the link at the newest save first. Decided
        # from bookkeeping only, so every rank reaches the link's barrier alike.
        newest, link = self._last_checkpoint_saved, self.last_model_path
        if self.save_last == "link" and link and newest and filepath not in (newest, link) and newest != link:
            self._link_checkpoint(trainer, newest, link)
        super()._remove_checkpoint(trainer, filepath)

"""Whether a checkpoint may be written and whether it can be resumed from: finite weights on every rank
(`check_finite`, `held_parameters`), a complete file or folder (`incomplete_reason`, `check_loadable`), and
the newest complete checkpoint that `ckpt_path="last"` resumes from (`newest_complete_checkpoint`). Used by
`exgrpo_pl.checkpointing`.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from exgrpo_pl.atomic_writes import COMPLETE_MARKER, local_path


class NonFiniteCheckpointError(ValueError):
    """A checkpoint's weights hold NaN or inf; nothing was written."""


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
    local = local_path(path) if path is not None else None
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

"""Whether a checkpoint may be written and whether it can be resumed from: finite weights on every rank
(`check_finite`, `held_parameters`, `check_restored_finite`), a complete and intact file or folder
(`incomplete_reason`, `check_loadable`), and the newest intact checkpoint that `ckpt_path="last"` resumes
from (`newest_complete_checkpoint`). Used by `exgrpo_pl.checkpoints.saving` and `ExGRPOModule`.

A checkpoint file is a zip archive (`torch.save`) that holds a CRC-32 for every record: the pickle and each
tensor's bytes. Every record is checked against its CRC before a resume, so a flipped bit on disk is an error
naming the record instead of a run that trains on with a corrupt weight. A check reads the whole file once
(`benchmarks/checkpoint_cost.py` gives its cost per GiB); a file already checked, unchanged since (same
size and modification time), is not read again in the same process.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import zipfile
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from exgrpo_pl.checkpoints.atomic_writes import COMPLETE_MARKER, local_path


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
    """Why `path` cannot be resumed from, or None when it is a complete, intact checkpoint.

    A file is intact when its zip index (written last by `torch.save`) is there and every record passes its
    CRC-32: this reads the whole file and unpickles nothing. A DeepSpeed checkpoint folder is complete once
    it holds `COMPLETE_MARKER` (DeepSpeed's own `latest` file is written by rank 0 alone, before the barrier
    that waits for the other ranks' shards) and every file DeepSpeed loads from it
    (`missing_deepspeed_file`), and intact when every checkpoint file in it is.

    Args:
        path: a checkpoint file, link or folder.
    """
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            return f"no {COMPLETE_MARKER} file in the folder: a rank may not have finished writing its shards"
        missing = missing_deepspeed_file(path)
        if missing is not None:
            return missing
        for root, _, names in sorted(os.walk(path)):
            for name in sorted(n for n in names if n.endswith(".pt")):  # DeepSpeed's shard files
                file = os.path.join(root, name)
                reason = _file_reason(file)
                if reason is not None:
                    return f"{os.path.relpath(file, path)}: {reason}"
        return None
    return _file_reason(path)


# A DeepSpeed shard: each data-parallel rank's optimizer states (`bf16_` under bf16), and under ZeRO-3 its
# model states too (DeepSpeed's `_get_ckpt_name`, `_get_rank_zero_ckpt_name`).
_SHARD = re.compile(
    r"^(?P<prefix>(?:bf16_)?zero_pp_rank_)(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_(?P<kind>optim|model)_states\.pt$"
)


def missing_deepspeed_file(folder: str) -> str | None:
    """The first file a DeepSpeed checkpoint folder lacks that DeepSpeed loads on resume, as a reason; None
    when none is missing.

    The tag folder (named in `latest`, else every sub-folder) must hold the model states: one
    `mp_rank_00_model_states.pt` below ZeRO-3, one `zero_pp_rank_<r>_mp_rank_00_model_states.pt` per rank
    under it; and each kind of per-rank file present (model or optimizer states) must be there for every
    rank up to the highest one found. Reads file names only, so a folder that lost every rank's optimizer
    states is not told from one saved without them (no ZeRO).

    Args:
        folder: a local DeepSpeed checkpoint folder.
    """
    latest = os.path.join(folder, "latest")
    if os.path.isfile(latest):
        with open(latest) as file:
            tags = [file.read().strip()]
    else:
        tags = sorted(name for name in os.listdir(folder) if os.path.isdir(os.path.join(folder, name)))
    for tag in tags:
        directory = os.path.join(folder, tag)
        if not os.path.isdir(directory):
            return f"{tag}/: the folder that its `latest` file names is missing"
        names = set(os.listdir(directory))
        shards = [match for match in map(_SHARD.match, names) if match is not None]
        ranks = 1 + max((int(match["rank"]) for match in shards), default=0)
        kinds = {(match["prefix"], match["mp"], match["kind"]) for match in shards}
        expected = {
            f"{prefix}{rank}_mp_rank_{mp}_{kind}_states.pt"
            for prefix, mp, kind in kinds
            for rank in range(ranks)
        }
        if not any(kind == "model" for _, _, kind in kinds):  # below ZeRO-3: one file of model states
            expected.add("mp_rank_00_model_states.pt")
        missing = sorted(expected - names)
        if missing:
            return (
                f"{tag}/{missing[0]} is missing ({len(missing)} file(s) in all): DeepSpeed cannot load the"
                " folder without it"
            )
    return None


_INTACT: set[tuple[str, int, int]] = set()  # (real path, size, mtime) of the files found intact


def _file_reason(path: str) -> str | None:
    """`record_reason(path)`, remembering the files found intact until they change."""
    try:
        stat = os.stat(path)
    except OSError as err:  # a dangling link, a missing file
        return f"{type(err).__name__}: {err}"
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    if key in _INTACT:
        return None
    reason = record_reason(path)
    if reason is None:
        _INTACT.add(key)
    return reason


def record_reason(path: str) -> str | None:
    """Why the checkpoint file `path` is not intact (not a complete zip, no pickle record, a record failing
    its CRC-32), or None. Reads every record once; unpickles nothing.

    Args:
        path: a file written by `torch.save`.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            if not any(name.endswith("data.pkl") for name in archive.namelist()):
                return "no data.pkl record"
            bad = archive.testzip()  # reads every record, checking each against its CRC-32
    except Exception as err:  # missing, empty, truncated, not a zip: all mean "cannot resume from this"
        return f"{type(err).__name__}: {err}"
    if bad is None:
        return None
    return (
        f"record {bad!r} fails its CRC-32 check: its bytes changed after it was written (disk or copy error)"
    )


def check_loadable(path: Any, option: str = "ckpt_path") -> None:
    """Raises ValueError naming `option` and `path` when `path` is a local file or folder that is not a
    complete, intact checkpoint (empty, truncated, corrupt, not a zip), instead of torch's bare `EOFError` or
    zip error, or a run that trains on from corrupt weights; and `NotALightningCheckpointError` when it is a
    file of other tensors (a plain `state_dict`), instead of Lightning's `KeyError`.

    Args:
        path: the checkpoint given; URLs, "last" and other non-files are left to the loader.
        option: the option it came from, for the message.
    """
    local = local_path(path) if path is not None else None
    if local is None or not os.path.exists(local):
        return
    reason = incomplete_reason(local)
    if reason is not None:
        raise ValueError(
            f"{option}={path}: not a complete, intact checkpoint ({reason}); a save into it was cut short,"
            " it was damaged on disk, or it is not a checkpoint. Give another one, or `last`, which takes"
            " the newest intact checkpoint."
        )
    if os.path.isfile(local):
        try:  # memory-mapped: reads the pickle, not the tensors' bytes
            checkpoint = torch.load(local, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:
            return  # it names code: the loader refuses it (`UnsafeCheckpointError`), naming what
        check_lightning_checkpoint(checkpoint, path, option)


class NotALightningCheckpointError(ValueError):
    """A checkpoint to resume from is not one Lightning saved (a plain `state_dict`, say)."""


def check_lightning_checkpoint(checkpoint: Any, path: Any, option: str = "ckpt_path") -> None:
    """Raises `NotALightningCheckpointError` naming `option`, `path` and what the file holds when
    `checkpoint` (what `torch.load` read from it) is not a checkpoint Lightning saved, which is what a resume
    needs (Lightning itself fails with `KeyError: 'pytorch-lightning_version'`), and says how to start from
    its weights instead.

    Args:
        checkpoint: the loaded file.
        path: the file, for the message.
        option: the option it came from, for the message.
    """
    if isinstance(checkpoint, dict) and "pytorch-lightning_version" in checkpoint:
        return
    if (
        isinstance(checkpoint, dict)
        and checkpoint
        and all(isinstance(v, torch.Tensor) for v in checkpoint.values())
    ):
        what = f"a plain state_dict ({len(checkpoint)} tensors, the first {next(iter(checkpoint))!r})"
    elif isinstance(checkpoint, dict):
        keys = ", ".join(repr(key) for key in list(checkpoint)[:5]) + (", ..." if len(checkpoint) > 5 else "")
        what = f"a dict of {len(checkpoint)} entries ({keys}) without 'pytorch-lightning_version'"
    else:
        what = f"a {type(checkpoint).__name__}"
    raise NotALightningCheckpointError(
        f"{option}={path}: {what}, not a checkpoint that Lightning saved; {option} resumes a run from one"
        " (what `exgrpo fit` or `Trainer.save_checkpoint` writes). To train from these weights instead, load"
        " them into the model (`model.load_state_dict`), save it with its tokenizer as a Hugging Face folder"
        " (`save_pretrained`) and give that folder as `model_name_or_path` (`--model.model_name_or_path`)."
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
    """The newest complete, intact `*.ckpt` in `directories`, warning about each newer one that is not.

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
                rank_zero_warn(
                    f'ckpt_path="last": skipping incomplete or corrupt {bad} ({why}); using {path}'
                )
            return path
        skipped.append((path, reason))
    if skipped:
        listing = "; ".join(f"{bad} ({why})" for bad, why in skipped)
        rank_zero_warn(
            f'ckpt_path="last": no complete, intact checkpoint, so none is loaded. Skipped: {listing}'
        )
    return None


class NonFiniteWeightsError(ValueError):
    """A resumed run's restored weights hold NaN or inf; no step was taken."""


def check_restored_finite(trainer, module: torch.nn.Module) -> None:
    """Raises `NonFiniteWeightsError` on every rank when the weights a run resumed with hold NaN or inf
    on any rank, naming the checkpoint and (on the ranks that hold it) the first such parameter. Call
    before the first training step of a resumed run.

    Args:
        trainer: the trainer, whose `ckpt_path` was restored.
        module: the (possibly sharded) module.
    """
    weights = held_parameters(module)
    name = first_non_finite(weights)
    if trainer.strategy.reduce_boolean_decision(name is None, all=True):
        return
    where = f"parameter {name!r}" if name is not None else "another rank's parameters"
    raise NonFiniteWeightsError(
        f"The weights restored from {trainer.ckpt_path} hold NaN or inf ({where}); training from them would"
        " only write more checkpoints like it. Resume from an earlier checkpoint."
    )

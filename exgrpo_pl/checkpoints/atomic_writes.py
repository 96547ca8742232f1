"""Writing files so that a kill at any moment leaves the old file or the new one, never a partial one.

A file is written under a temp name next to its final path (`temp_path`, a dot file no checkpoint lookup
matches), flushed, fsynced and renamed over the final name, and the directory is fsynced
(`save_atomically` for a checkpoint, `write_files_atomically` for text files written together, such as an
evaluation's JSON and Markdown tables or a run's config.yaml); a link is replaced by renaming a new link
over it (`link_atomically`); a DeepSpeed checkpoint folder is complete once it holds `COMPLETE_MARKER`
(`mark_complete`). The temp files of killed writes are deleted by the next save into their directory
(`remove_stale_temp_files`), and a full disk is named with the file and the space needed
(`OutOfSpaceError`). Used by `exgrpo_pl.checkpoints.saving` and `exgrpo_pl.cli`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

# `.<final name>.tmp-<pid>-<8 hex>`: a dot file, so no "*.ckpt" glob and no "last" lookup ever matches it.
TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}$")
# Written into a DeepSpeed checkpoint folder once every rank has written its part (`mark_complete`).
COMPLETE_MARKER = "exgrpo-complete"


def local_path(path: Any) -> str | None:
    """`path` as a local filesystem path, or None for a remote URL (left to Lightning's writer)."""
    fs, local = url_to_fs(str(path))
    return local if isinstance(fs, LocalFileSystem) else None


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


def _write_temp(path: str, write: Callable[[BinaryIO], None], needed_bytes: int, kept: str) -> str:
    """Writes a temp file next to `path` with `write(file)`, flushed and fsynced; returns its name.

    Raises:
        OutOfSpaceError: the filesystem filled up (the temp file is deleted); its message ends with `kept`.
    """
    temp = temp_path(path)
    try:
        with open(temp, "xb") as file:  # unlike mkstemp's 0600, the file gets the umask's mode
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp)
        raise_if_out_of_space(err, path, needed_bytes, kept)
        raise
    return temp


def _replace_all(temps: dict[str, str]) -> None:
    """Renames each temp file over its final path (final path -> temp), then fsyncs their directories; a
    temp file not renamed because a rename failed is deleted."""
    try:
        for path, temp in temps.items():
            os.replace(temp, path)
    except BaseException:
        for temp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)  # those renamed are gone already
        raise
    for directory in {os.path.dirname(os.path.abspath(path)) for path in temps}:
        _fsync_directory(directory)


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
    temp = _write_temp(
        path, functools.partial(torch.save, checkpoint), tensor_bytes(checkpoint), _CHECKPOINTS_KEPT
    )
    _replace_all({path: temp})


def write_files_atomically(contents: Mapping[str | os.PathLike, str]) -> None:
    """Writes text files together: each into a temp file next to it, and only once every one is written,
    each renamed over its final path, so an error or a full disk leaves every old file as it was.

    A kill leaves each file old or new, never partial; a kill between two renames (after every byte is on
    disk) leaves the files renamed so far new and the others old, with the others' temp files, which the
    next write into the directory deletes. The first file is renamed last: it is the set's commit point,
    and can name the others (as `exgrpo test`'s JSON names its Markdown's digest), so a reader tells a
    mixed set from a whole one. Stale temp files in the files' directories are deleted first; missing
    directories are made.

    Args:
        contents: final local path -> its text (UTF-8); the first is renamed into place last.

    Raises:
        OutOfSpaceError: the filesystem filled up (the temp files are deleted, no file is replaced).
    """
    encoded = {os.fspath(path): text.encode() for path, text in contents.items()}
    for directory in {os.path.dirname(os.path.abspath(path)) for path in encoded}:
        os.makedirs(directory, exist_ok=True)
        remove_stale_temp_files(directory)
    temps: dict[str, str] = {}
    try:
        for path, data in encoded.items():
            temps[path] = _write_temp(path, lambda file, data=data: file.write(data), len(data), _FILES_KEPT)
    except BaseException:
        for temp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        raise
    _replace_all(dict(reversed(temps.items())))


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


_CHECKPOINTS_KEPT = (
    "Nothing was written and existing checkpoints are untouched; free some space, or save elsewhere (the"
    " checkpoint callback's `dirpath`, `trainer.default_root_dir`)."
)
_FILES_KEPT = (
    "Nothing was written: the files there are as they were. Free some space, or write elsewhere"
    " (`trainer.default_root_dir`, the logger's `save_dir`)."
)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"


def raise_if_out_of_space(
    err: BaseException, path: str, needed_bytes: int, kept: str = _CHECKPOINTS_KEPT
) -> None:
    """Raises `OutOfSpaceError` from `err` when it, or an error it arose from, says the disk or quota is full.

    torch's writer turns the `OSError` of a full disk into a bare `RuntimeError` ("unexpected pos"), which
    keeps the OSError as its context; that chain is what is read here.

    Args:
        err: the error a write raised.
        path: what was being written.
        needed_bytes: what the write needs at least.
        kept: what the failed write left as it was, and what to do; the message's last sentences.
    """
    cause, seen = err, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
            raise OutOfSpaceError(
                errno.ENOSPC,
                f"No space left to write {path}: it needs at least {_size(needed_bytes)} and {_size(free)}"
                f" is free there ({cause.strerror}). {kept}",
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
    """Writes `COMPLETE_MARKER` into a checkpoint folder (`write_files_atomically`): call it once every rank
    has finished writing into the folder.

    Args:
        folder: a local DeepSpeed checkpoint folder.
    """
    write_files_atomically({os.path.join(folder, COMPLETE_MARKER): "every rank's shards are written\n"})


def mark_incomplete(folder: str) -> None:
    """Removes `COMPLETE_MARKER` from a checkpoint folder about to be saved into again (nothing if absent).

    Args:
        folder: a local DeepSpeed checkpoint folder.
    """
    _delete(os.path.join(folder, COMPLETE_MARKER))

"""Shipped config files that were renamed: their old paths work, with a warning, until `REMOVED_IN`.

`configs/exgrpo_seed.yaml` is `configs/exgrpo_swap.yaml` since 0.1.0: the preset of the reference
description's probabilistic swap (the written description of ExGRPO that the library's objects and defaults
follow), whose old name read as a random seed. `exgrpo_pl.cli` passes its arguments
through `with_renamed_configs` before it parses them: a `--config` (or `-c`) path that does not exist, whose
file name is an old one of `RENAMED` and whose folder holds the new one, is read from the new file, with a
`RenamedConfigWarning` (a `FutureWarning`, shown by default, as `exgrpo_pl.moved` warns of a moved module)
that names the new file and the version that removes the old name; from that version on, with a
`RenamedConfigError` that names the new file. A path that exists is read as it is, whatever its name.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from exgrpo_pl.moved import REMOVED_IN, removed

RENAMED = {"exgrpo_seed.yaml": "exgrpo_swap.yaml"}
"""Old file name of a shipped config -> its new one, in the same folder."""


class RenamedConfigWarning(FutureWarning):
    """A renamed config was named by its old path; it is read from the new one until `REMOVED_IN`."""


class RenamedConfigError(FileNotFoundError):
    """A renamed config was named by its old path after `REMOVED_IN`: the message names the new one."""


def renamed_config(path: str) -> str | None:
    """The new path of a renamed config named by its old `path`, or None: `path` exists, its file name is not
    an old name, or its folder does not hold the new file."""
    old = Path(path)
    new = old.with_name(RENAMED[old.name]) if old.name in RENAMED else None
    return str(new) if new is not None and not old.exists() and new.is_file() else None


def renamed_message(old: str, new: str) -> str:
    """'configs/exgrpo_seed.yaml was renamed configs/exgrpo_swap.yaml (the old name ...)', saying whether
    the old name still works."""
    when = "was removed in" if removed() else "is read from the new file and is removed in"
    return f"{old} was renamed {new} (the old name {when} exgrpo-pl {REMOVED_IN})"


def renamed_config_args(args: list[str]) -> list[str]:
    """`args` with each renamed config's old path after `--config`, `--config=`, `-c` or `-c=` replaced by
    its new one, with one `RenamedConfigWarning` each; `RenamedConfigError` once the old names are removed.

    Args:
        args: the command line's arguments, without the program's name.
    """
    out = list(args)
    for i, arg in enumerate(out):
        flag, equals, value = arg.partition("=")
        if equals and flag in ("--config", "-c"):
            prefix = flag + "="
        elif i > 0 and out[i - 1] in ("--config", "-c"):
            prefix, value = "", arg
        else:
            continue
        new = renamed_config(value)
        if new is None:
            continue
        if removed():
            raise RenamedConfigError(renamed_message(value, new))
        warnings.warn(renamed_message(value, new), RenamedConfigWarning, stacklevel=3)
        out[i] = prefix + new
    return out


def with_renamed_configs(args):
    """The CLI's arguments with renamed configs' new paths (`renamed_config_args`). None (the command line)
    stays None, and `sys.argv` is rewritten in place: LightningCLI parses `sys.argv` when given None, and the
    ranks a launcher starts from `sys.argv` then read the new file without warning again. A dict of
    arguments is returned as it is.

    Args:
        args: what `LightningCLI` was given: None, a list of arguments, or a dict.
    """
    if args is None:
        sys.argv[1:] = renamed_config_args(sys.argv[1:])
        return None
    return renamed_config_args(list(args)) if isinstance(args, list | tuple) else args

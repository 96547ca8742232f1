"""Run names: the `exgrpo` command's log folder for a run is named after its config and seed.

TensorBoard lists runs by their folder under `--logdir`. Lightning's default names them `version_0`,
`version_1`, ..., which says nothing about what each run is; `exgrpo fit --config configs/exgrpo.yaml` (seed
0) logs to `exgrpo-s0` instead, and `configs/grpo_baseline.yaml` beside it to `grpo_baseline-s0`. A second run
of the same config and seed keeps the name with a number (`exgrpo-s0-v1`, `-v2`, ...), so no run writes into
another's folder. `--run_name NAME` gives the name outright (numbered the same way when taken).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

NO_CONFIG = "run"  # the name's first part when no config file was given
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")  # what may not stand in a folder name on every filesystem


def run_name(config_files: Iterable[str | os.PathLike], seed: int | None) -> str:
    """`<config stems joined by +>-s<seed>`: `exgrpo-s0` for `--config configs/exgrpo.yaml` and seed 0.

    Args:
        config_files: the `--config` files, in the order given; none gives `run`.
        seed: the run's `seed_everything`; None (no seed set) leaves the `-s` part out.
    """
    stems = [Path(str(path)).stem for path in config_files]
    base = "+".join(stems) if stems else NO_CONFIG
    return safe_name(base if seed is None else f"{base}-s{seed}")


def safe_name(name: str) -> str:
    """`name` as a folder name: each run of characters other than letters, digits and `._+-` becomes `_`.

    Raises:
        ValueError: when nothing is left of it (an empty name, or only dots), naming the value.
    """
    safe = _UNSAFE.sub("_", str(name)).strip()
    if not safe.strip("."):
        raise ValueError(f"run_name={name!r}: a run's folder needs a name with a letter or a digit")
    return safe


def free_version(root: str | os.PathLike, name: str) -> str:
    """`name`, or `name-v1`, `name-v2`, ... : the first that is not yet a folder in `root`."""
    taken = set(os.listdir(root)) if os.path.isdir(root) else set()
    if name not in taken:
        return name
    number = 1
    while f"{name}-v{number}" in taken:
        number += 1
    return f"{name}-v{number}"

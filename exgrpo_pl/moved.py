"""Where the modules of the flat layout went: their old paths work, with a warning, until `REMOVED_IN`.

Until 0.1.0 the package's modules sat side by side (`exgrpo_pl.buffer`, `exgrpo_pl.checkpointing`, ...); they
now live in folders that show its architecture (`experience/`, `step/`, `module/`, `checkpoints/`). `MOVED`
maps each old module to its new one. `OldPathFinder`, which `exgrpo_pl/__init__.py` puts first on
`sys.meta_path` (before a finder that could find an older copy of the file that an editable install still
maps), answers exactly those names: until `REMOVED_IN` with a stand-in module that warns
(`MovedModuleWarning`, a `FutureWarning`: shown by default, as pandas and NumPy show their deprecations,
without touching the process's warning filters) and hands out the
new module's names, and from that version on with `ModuleMovedError`. `exgrpo_pl.cli` checks its config files
and arguments against the same table before it parses them (`old_paths_in`), so a config's old `class_path`
is named with its file and line.

`exgrpo_pl.module` is not in the table: it is the module's folder now, and `ExGRPOModule` and `ReplayMixin`
import from it as before (the rest of the old module.py is in `exgrpo_pl.module.grpo`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import re
import sys
import warnings

MOVED = {
    "exgrpo_pl.buffer": "exgrpo_pl.experience.buffer",
    "exgrpo_pl.buffer_storage": "exgrpo_pl.experience.storage",
    "exgrpo_pl.buffer_sampling": "exgrpo_pl.experience.sampling",
    "exgrpo_pl.buffer_dedup": "exgrpo_pl.experience.dedup",
    "exgrpo_pl.difficulty": "exgrpo_pl.experience.difficulty",
    "exgrpo_pl.rate_tiers": "exgrpo_pl.experience.rate_tiers",
    "exgrpo_pl.bucket_draw": "exgrpo_pl.experience.bucket_draw",
    "exgrpo_pl.replay": "exgrpo_pl.experience.replay",
    "exgrpo_pl.rollout_plan": "exgrpo_pl.step.plan",
    "exgrpo_pl.collect": "exgrpo_pl.step.collect",
    "exgrpo_pl.groups": "exgrpo_pl.step.groups",
    "exgrpo_pl.group_assembly": "exgrpo_pl.step.assembly",
    "exgrpo_pl.group_sampling": "exgrpo_pl.step.sampling",
    "exgrpo_pl.group_forward": "exgrpo_pl.step.forward",
    "exgrpo_pl.update": "exgrpo_pl.step.update",
    "exgrpo_pl.losses": "exgrpo_pl.step.losses",
    "exgrpo_pl.logprobs": "exgrpo_pl.step.logprobs",
    "exgrpo_pl.rollout": "exgrpo_pl.step.rollout",
    "exgrpo_pl.rollout_memory": "exgrpo_pl.step.rollout_memory",
    "exgrpo_pl.module_options": "exgrpo_pl.module.options",
    "exgrpo_pl.module_evaluation": "exgrpo_pl.module.evaluation",
    "exgrpo_pl.module_resume": "exgrpo_pl.module.resumable",
    "exgrpo_pl.mixin": "exgrpo_pl.module.mixin",
    "exgrpo_pl.logging_steps": "exgrpo_pl.module.logging_steps",
    "exgrpo_pl.strategies": "exgrpo_pl.module.strategies",
    "exgrpo_pl.atomic_writes": "exgrpo_pl.checkpoints.atomic_writes",
    "exgrpo_pl.checkpoint_integrity": "exgrpo_pl.checkpoints.integrity",
    "exgrpo_pl.checkpointing": "exgrpo_pl.checkpoints.saving",
    "exgrpo_pl.resume": "exgrpo_pl.checkpoints.resume",
}
"""Old dotted module name -> its new one."""

SHORTER = {
    "exgrpo_pl.buffer": "TrajectoryBuffer imports from exgrpo_pl.experience",
    "exgrpo_pl.difficulty": "DifficultyBucketer imports from exgrpo_pl.experience",
    "exgrpo_pl.replay": "SelectiveReplay imports from exgrpo_pl.experience",
    "exgrpo_pl.checkpointing": "AtomicCheckpointIO and SafeModelCheckpoint import from exgrpo_pl.checkpoints",
    "exgrpo_pl.mixin": "ReplayMixin imports from exgrpo_pl.module",
    "exgrpo_pl.losses": (
        "compute_grpo_loss, compute_importance_weights and group_advantages import from exgrpo_pl"
    ),
    "exgrpo_pl.rollout": (
        "sample_completions, plain_generation_config, position_ids_from_mask and completion_mask_from_ids "
        "moved to exgrpo_pl.engines.generation, and compute_entropy imports from exgrpo_pl"
    ),
}
"""Old module -> where its public names import from, where that is not (only) the new module."""

ELSEWHERE = {"exgrpo_pl.rollout": ["exgrpo_pl.engines.generation"]}
"""Old module -> the modules that hold the names it had and its new module has not."""

REMOVED_IN = "0.3.0"
"""The first version of exgrpo-pl in which an old path is an error, not a warning."""


def _installed_version() -> str:
    try:
        return importlib.metadata.version("exgrpo-pl")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, never installed
        return "0"


VERSION = _installed_version()


def _release(version: str) -> tuple[int, ...]:
    """'0.3.0rc1' -> (0, 3, 0): a pre-release of the version that removes the old paths removes them too."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def removed() -> bool:
    """Whether this version of exgrpo-pl has removed the old paths (`REMOVED_IN` or later)."""
    return _release(VERSION) >= _release(REMOVED_IN)


class MovedModuleWarning(FutureWarning):
    """An old module path was used; it works until `REMOVED_IN`. A `FutureWarning`, which Python shows by
    default, so the package changes no warning filter: `-W error::FutureWarning` (or `error::` this class)
    makes it an error in a test run."""


_DOTTED = re.compile(r"(?<![\w.])exgrpo_pl(?:\.\w+)+")


class ModuleMovedError(ModuleNotFoundError):
    """An old module's path, imported or named in a config: the message names its new module.

    `name` is left unset: `from exgrpo_pl import buffer` would otherwise swallow this error, as it swallows a
    submodule that is simply missing, and say only "cannot import name 'buffer'".
    """

    def __init__(self, old: str, message: str | None = None):
        super().__init__(message or moved_message(old))
        self.old, self.new = old, MOVED[old]


def moved_message(old: str) -> str:
    """'exgrpo_pl.buffer moved to exgrpo_pl.experience.buffer; TrajectoryBuffer imports from ... (the old
    path ...)', saying whether the old path still works."""
    when = "was removed in" if removed() else "is deprecated and is removed in"
    parts = [f"{old} moved to {MOVED[old]}", *([SHORTER[old]] if old in SHORTER else [])]
    return f"{'; '.join(parts)} (the old path {when} exgrpo-pl {REMOVED_IN})"


class OldPathFinder:
    """A `sys.meta_path` finder for the old modules only: a stand-in module that warns (`_OldPathLoader`), or
    `ModuleMovedError` once they are removed."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MOVED:
            return None
        if removed():
            raise ModuleMovedError(fullname)
        return importlib.util.spec_from_loader(fullname, _OldPathLoader())


class _OldPathLoader(importlib.abc.Loader):
    """Makes an old module a stand-in that warns once, when imported, and looks every name up in the new
    module (then in `ELSEWHERE`'s), so `from exgrpo_pl.buffer import TrajectoryBuffer` and a config's
    `class_path: exgrpo_pl.buffer.TrajectoryBuffer` give the class itself."""

    def create_module(self, spec):
        return None  # the default module, filled by exec_module

    def exec_module(self, module) -> None:
        old = module.__name__
        # stacklevel 2: the first frame outside importlib's own, the importing line.
        warnings.warn(moved_message(old), MovedModuleWarning, stacklevel=2)
        sources = [importlib.import_module(name) for name in [MOVED[old], *ELSEWHERE.get(old, [])]]

        def __getattr__(name: str):
            for source in sources:
                if hasattr(source, name):
                    return getattr(source, name)
            raise AttributeError(f"module {old!r} (now {MOVED[old]}) has no attribute {name!r}")

        module.__getattr__ = __getattr__
        module.__all__ = sorted({name for source in sources for name in _public(source)})


def _public(module) -> list[str]:
    return getattr(module, "__all__", None) or [
        name for name, value in vars(module).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__
    ]  # fmt: skip


def install() -> None:
    """Put an `OldPathFinder` first on `sys.meta_path` (once): before the finders that could find an older
    copy of an old module, such as an editable install's."""
    if not any(isinstance(finder, OldPathFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPathFinder())


def old_paths_in(text: str) -> list[tuple[str, str]]:
    """(dotted name, old module) for each dotted name in `text` that starts with an old module, in order:
    `exgrpo_pl.buffer.TrajectoryBuffer` gives `("exgrpo_pl.buffer.TrajectoryBuffer", "exgrpo_pl.buffer")`."""
    found = []
    for match in _DOTTED.finditer(text):
        old = ".".join(match.group().split(".")[:2])
        if old in MOVED:
            found.append((match.group(), old))
    return found

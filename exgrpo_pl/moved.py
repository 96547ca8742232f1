"""Where the modules of the flat layout went, and the error an old path raises.

Until 0.1.0 the package's modules sat side by side (`exgrpo_pl.buffer`, `exgrpo_pl.checkpointing`, ...); they
now live in folders that show its architecture (`experience/`, `step/`, `module/`, `checkpoints/`). An old
path, in an import or in a config's `class_path`, would otherwise fail with a bare "No module named ...", or
find an older copy of the file that an editable install still maps. `MOVED` maps each old module to its new
one. `OldPathFinder`, which `exgrpo_pl/__init__.py` puts first on `sys.meta_path`, raises `ModuleMovedError`
naming the new module for exactly those names (every other import passes it by), and `exgrpo_pl.cli` checks
its config files and arguments against the same table before it parses them (`old_paths_in`).

`exgrpo_pl.module` is not in the table: it is the module's folder now, and `ExGRPOModule` and `ReplayMixin`
import from it as before (the rest of the old module.py is in `exgrpo_pl.module.grpo`).
"""

from __future__ import annotations

import re
import sys

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
    """'exgrpo_pl.buffer moved to exgrpo_pl.experience.buffer; TrajectoryBuffer imports from ...'."""
    return "; ".join([f"{old} moved to {MOVED[old]}", *([SHORTER[old]] if old in SHORTER else [])])


class OldPathFinder:
    """A `sys.meta_path` finder that raises `ModuleMovedError` for the old modules and finds nothing else."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname in MOVED:
            raise ModuleMovedError(fullname)
        return None


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

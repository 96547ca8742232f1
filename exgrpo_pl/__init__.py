"""exgrpo-pl: ExGRPO (GRPO with selective experience replay) for PyTorch Lightning.

The seed's objects import from the top level without Lightning:

    from exgrpo_pl import TrajectoryBuffer, DifficultyBucketer, SelectiveReplay

The Lightning pieces live in `exgrpo_pl.module` (ExGRPOModule) and `exgrpo_pl.callbacks`.
"""

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience.buffer import TrajectoryBuffer
from exgrpo_pl.experience.difficulty import DifficultyBucketer
from exgrpo_pl.experience.replay import SelectiveReplay
from exgrpo_pl.step.losses import compute_grpo_loss, compute_importance_weights, group_advantages
from exgrpo_pl.step.rollout import compute_entropy

__all__ = [
    "DifficultyBucketer",
    "RolloutBatch",
    "SelectiveReplay",
    "TrajectoryBuffer",
    "compute_entropy",
    "compute_grpo_loss",
    "compute_importance_weights",
    "group_advantages",
]

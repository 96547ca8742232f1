"""exgrpo-pl: ExGRPO (GRPO with selective experience replay) for PyTorch Lightning.

The reference description's objects (the reference description: the short written description of ExGRPO,
with an API sketch and a hand-written loop, that the library's objects and defaults follow; not the paper)
import from the top level without Lightning:

    from exgrpo_pl import TrajectoryBuffer, DifficultyBucketer, SelectiveReplay

The Lightning pieces live in `exgrpo_pl.module` (ExGRPOModule) and `exgrpo_pl.callbacks`.

The package's folders, bottom to top (each imports only from those before it; tests/test_import_graph.py
checks it): the shared basics at the top level (`batch`, `ragged`, `seeding`, `validation`, `contract`,
`models`, `lightning_internals`), `rewards/`, `engines/`, `data/`, `evaluation/`, `experience/` (the replay
memory), `step/` (one training step), `checkpoints/`, `module/` (the LightningModule and `ReplayMixin`),
`callbacks/` and `cli`. The modules of the earlier flat layout moved into them: an old path still imports,
with a warning that names the new one and the version that removes it (`exgrpo_pl.moved`).
"""

from exgrpo_pl import moved
from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience.buffer import TrajectoryBuffer
from exgrpo_pl.experience.difficulty import DifficultyBucketer
from exgrpo_pl.experience.replay import SelectiveReplay
from exgrpo_pl.step.losses import compute_grpo_loss, compute_importance_weights, group_advantages
from exgrpo_pl.step.rollout import compute_entropy

moved.install()  # old module paths warn, naming the new one

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

"""The LightningModule, and what a GRPO module of your own mixes in to train with replay.

- `grpo`: `ExGRPOModule`, a complete GRPO trainer whose `training_step` runs `exgrpo_pl.step`'s stages.
- `options`: its options' ranges and choices, checked when it is built.
- `evaluation`: its validation and test (pass@1, the paper's metrics on named evaluation sets).
- `resumable`: what its checkpoints keep besides the weights, and what it does on resuming.
- `mixin`: `ReplayMixin`, what `ReplayCallback` needs from a GRPO module of your own.
- `logging_steps`: when step metrics reach the loggers (the module and the callbacks log only then).
- `strategies`: DeepSpeed and FSDP checks (`check_strategy`) and the helpers for sharded training.

Layer: above the training step (`exgrpo_pl.step`), the checkpoints (`exgrpo_pl.checkpoints`), the data,
evaluation, engines and rewards, and the shared basics, all of which it may import; below the callbacks and
the CLI, which it never imports. The two classes import from here:

    from exgrpo_pl.module import ExGRPOModule, ReplayMixin
"""

from exgrpo_pl.module.grpo import ExGRPOModule
from exgrpo_pl.module.mixin import ReplayMixin

__all__ = ["ExGRPOModule", "ReplayMixin"]

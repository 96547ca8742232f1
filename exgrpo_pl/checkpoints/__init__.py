"""Checkpoints a kill cannot corrupt, and exact resume.

- `saving`: `AtomicCheckpointIO` (write under a temp name, rename into place, refuse non-finite weights) and
  `SafeModelCheckpoint` (save whatever stopped training, `ckpt_path="last"` = the newest complete checkpoint).
- `atomic_writes`: writing a file or a link so that a kill leaves the old one or the new one.
- `integrity`: whether a checkpoint may be written (finite weights) and resumed from (complete, intact).
- `resume`: what a checkpoint's loops, RNG states and loader position need to resume exactly.

Layer: above the shared basics (Lightning's private API through `exgrpo_pl.lightning_internals`), and
importing nothing of the training step or the module; `exgrpo_pl.module` (its checkpoint hooks) and
`exgrpo_pl.cli` (installed by default) use it. The two classes import from here:

    from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
"""

from exgrpo_pl.checkpoints.saving import AtomicCheckpointIO, SafeModelCheckpoint

__all__ = ["AtomicCheckpointIO", "SafeModelCheckpoint"]

"""ExGRPO's experience management, the replay memory: what is stored, how hard each question is, what is
replayed.

- `buffer`: `TrajectoryBuffer`, what is stored (and retired), composed of `storage` (the slots, their columns
  and token payloads, eviction), `sampling` (the replay strategies' draw) and `dedup` (one copy of a
  completion per question).
- `difficulty`: `DifficultyBucketer`, each question's windowed correctness rate and tier, with `rate_tiers`
  (a rate's tier) and `bucket_draw` (the paper's draw of questions by rate bucket).
- `replay`: `SelectiveReplay`, when to replay and which experience.

Layer: above the shared basics (`exgrpo_pl.batch`, `ragged`, `seeding`, `validation`), and importing only
them: plain PyTorch/NumPy, no Lightning, no model, nothing of the training step. The callbacks
(`exgrpo_pl.callbacks.ReplayCallback`) put it to work. The three classes import from here:

    from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
"""

from exgrpo_pl.experience.buffer import TrajectoryBuffer
from exgrpo_pl.experience.difficulty import DifficultyBucketer
from exgrpo_pl.experience.replay import SelectiveReplay

__all__ = ["DifficultyBucketer", "SelectiveReplay", "TrajectoryBuffer"]

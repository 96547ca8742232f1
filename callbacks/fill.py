"""When `ReplayCallback`'s buffer fills (its `fill_from`): from the first step, or, as the official ExGRPO
code does, from the switch to mixed batches on, the steps before it only retiring the questions they solved.
"""

from __future__ import annotations

import torch

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience.buffer import TrajectoryBuffer

FILL_FROM = ("start", "replay_start")
"""`fill_from`'s choices: store every step's rollouts, or those of steps that begin in the replay phase."""


def retire_solved(buffer: TrajectoryBuffer, rollouts: RolloutBatch) -> None:
    """Feeds the bucketer only the groups of `rollouts` that every rollout answered correctly, storing
    nothing: their questions retire as they would from a full `add` (the official code retires from the first
    step, and buckets and stores only from the switch to mixed batches)."""
    solved = rollouts.correct.view(-1, rollouts.group_size).all(dim=1)  # [groups]
    if not bool(solved.any()):
        return
    rows = torch.nonzero(solved.repeat_interleave(rollouts.group_size)).squeeze(1)  # [solved rows]
    domains = None if rollouts.domains is None else [rollouts.domains[r] for r in rows.tolist()]
    retired = buffer.bucketer.update(rollouts.question_ids[rows], rollouts.rewards[rows], domains)
    if len(retired):
        buffer.remove_questions(retired)

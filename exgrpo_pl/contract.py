"""The contract between a GRPO LightningModule and the replay callbacks (DESIGN.md section 3).

A user's own GRPO module works with `ReplayCallback` if it follows `ReplayableModule`:

- the training batch is a dict; the callback may put `batch["experience"] = Experience(...)` into it in
  `on_train_batch_start` (the same dict object reaches `training_step`);
- `training_step` honours that entry and returns `{"loss": ..., "rollouts": RolloutBatch}` with what it
  trained on (fresh rows with their behaviour log-probs, replayed rows flagged);
- `score_entropy` rescores stored trajectories under the current policy (the paper's selection), and
  `entropy_forwards` says how many policy forwards that takes, so that under ZeRO-3 the callback can make
  every rank run the same number (each forward there is a collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor

from exgrpo_pl.batch import RolloutBatch

REPLAY_MODES = ("swap", "mix")


@dataclass
class Experience:
    """Replayed trajectories for one training step.

    Args:
        mode: "swap" (the seed): train on `rollouts` alone, generating nothing, with the advantages they
            carry. "mix" (the paper): each row is one question's stored trajectory; the module replaces as
            many on-policy questions of the batch, generates K-1 fresh rollouts per replayed question and
            computes advantages over the whole group of K.
        rollouts: the sampled trajectories (`replayed` is True on every row).
    """

    mode: Literal["swap", "mix"]
    rollouts: RolloutBatch

    def __post_init__(self) -> None:
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"Experience.mode={self.mode!r}; allowed: {', '.join(REPLAY_MODES)}")


@runtime_checkable
class ReplayableModule(Protocol):
    """What `ReplayCallback` needs from a LightningModule (besides honouring `batch["experience"]`)."""

    num_generations: int
    """K, rollouts per question."""

    def score_entropy(self, rollouts: RolloutBatch, num_forwards: int | None = None) -> Tensor:
        """`[N]` mean completion-token entropy of `rollouts` under the current policy.

        `num_forwards`: None runs the forwards `rollouts` need; a number (at least
        `entropy_forwards(rollouts)`, and `rollouts` may be empty) runs exactly that many policy forwards,
        padding with dummy ones whose results are discarded. Under ZeRO-3/FSDP each forward gathers the
        sharded parameters from every rank, and the callback asks each rank for the same count.
        """
        ...

    def entropy_forwards(self, rollouts: RolloutBatch) -> int:
        """How many policy forwards `score_entropy(rollouts)` runs (e.g. its micro-batches)."""
        ...

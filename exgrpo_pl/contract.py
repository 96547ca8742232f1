"""The contract between a GRPO LightningModule and the replay callbacks, and the checks that enforce it.

A user's own GRPO module works with `ReplayCallback` if it follows `ReplayableModule` (the whole contract,
field by field: docs/replay_contract.md):

- the training batch is a dict with `prompt` (a list with one prompt per question: text, or a list of chat
  messages) and `question_id` (`[B]` long tensor of stable ids); the callback may put
  `batch["experience"] = Experience(...)` into it in `on_train_batch_start` (the same dict object reaches
  `training_step`);
- `training_step` honours that entry and returns `{"loss": ..., "rollouts": RolloutBatch}` with what it
  trained on (fresh rows with their behaviour log-probs, replayed rows flagged);
- `score_entropy` rescores stored trajectories under the current policy (the paper's selection), and
  `entropy_forwards` says how many policy forwards that takes, so that under ZeRO-3 the callback can make
  every rank run the same number (each forward there is a collective).

The checks that say what is wrong and what to return instead are in `exgrpo_pl.contract_checks`;
`ReplayCallback` runs them through its `StepChecker`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from torch import Tensor

from exgrpo_pl.batch import RolloutBatch

REPLAY_MODES = ("swap", "mix")
# Where a mixed step's experience goes: in place of the batch's last questions, into the groups of those
# same questions (the callback put them last), or in place of groups whose K rewards came out all equal.
PLACEMENTS = ("displace", "join", "refill")
CONTRACT_DOC = "docs/replay_contract.md"
BATCH_KEYS = {
    "prompt": "list of prompts, one per question: str, or a list of chat messages",
    "question_id": "[B] long tensor of stable question ids",
}
RETURN_FIX = (
    'return {"loss": loss, "rollouts": rollouts} from training_step, rollouts being the RolloutBatch the '
    "step trained on (ReplayMixin.replay_groups or exgrpo_pl.step.groups.sample_groups builds it)"
)


@dataclass
class Experience:
    """Replayed trajectories for one training step.

    Args:
        mode: "swap" (the reference description): train on `rollouts` alone, generating nothing, with the
            advantages they carry. "mix" (the paper): each row is one question's stored trajectory; the module
            replaces as many on-policy questions of the batch, generates K-1 fresh rollouts per replayed
            question and computes advantages over the whole group of K.
        rollouts: the sampled trajectories (`replayed` is True on every row).
        placement: mix mode: "displace" and "join" are the mix above (for "join" the rows are stored
            trajectories of the batch's last questions themselves); "refill": `rollouts` is a pool, and after
            scoring the fresh groups the module gives the places of groups whose K rewards are all equal to
            the pool's first rows (as many on every rank), each with K-1 rollouts of a second round.
    """

    mode: Literal["swap", "mix"]
    rollouts: RolloutBatch
    placement: Literal["displace", "join", "refill"] = "displace"

    def __post_init__(self) -> None:
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"Experience.mode={self.mode!r}; allowed: {', '.join(REPLAY_MODES)}")
        if self.placement not in PLACEMENTS or (self.mode == "swap" and self.placement != "displace"):
            raise ValueError(f"Experience(mode={self.mode!r}) placement={self.placement!r}; allowed: "
                             f"{', '.join(PLACEMENTS) if self.mode == 'mix' else 'displace'}")  # fmt: skip


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


class ContractError(ValueError):
    """What a module or datamodule handed the callbacks breaks the contract; the message has the fix."""

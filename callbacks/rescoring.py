"""One replay step's rescoring of stored trajectories under the current policy (`ReplayCallback`'s
`entropy_fn`), in step across ranks where every policy forward is a collective (ZeRO-3, FSDP)."""

from __future__ import annotations

import time

import torch
from lightning.pytorch import LightningModule, Trainer

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.callbacks.collectives import max_across_ranks
from exgrpo_pl.experience.sampling import OFFICIAL_PICK


class Rescoring:
    """The `entropy_fn` of one replay step: scores candidates under the current policy, and times it.

    With `synced` (ZeRO-3/FSDP: every forward is a collective) a call is this rank's rescoring round: the
    ranks agree on the largest forward count (all-reduce max; this rank's is 0 without candidates), then
    each runs exactly that many, the surplus being discarded dummy forwards. Every rank takes part in one
    round per step: the buffer calls `entropy_fn` once per sample, or not at all when the sampled questions
    have no stored trajectory, and `join` then runs the round with nothing to score.
    """

    def __init__(self, trainer: Trainer, pl_module: LightningModule, synced: bool, selection: str) -> None:
        self.trainer = trainer
        self.pl_module = pl_module
        self.synced = synced
        # The official code's score for its selection, the paper's mean completion entropy for the others.
        official = selection == OFFICIAL_PICK
        self.score = pl_module.score_official_entropy if official else pl_module.score_entropy
        self.rounds = 0
        self.seconds = 0.0

    def __call__(self, candidates: RolloutBatch) -> torch.Tensor:
        if self.synced and self.rounds:
            # A second round on this rank only would leave the other ranks waiting in their next collective.
            raise RuntimeError("entropy_fn called twice in one sample(): ranks would fall out of step")
        started = time.perf_counter()
        with torch.no_grad():
            if self.synced:
                forwards = max_across_ranks(self.trainer, self.pl_module.entropy_forwards(candidates))
                scores = self.score(candidates, num_forwards=forwards)
            else:
                scores = self.score(candidates)
        self.rounds += 1
        self.seconds += time.perf_counter() - started
        return scores.cpu()

    def join(self, sampled: RolloutBatch) -> None:
        """Take part in the round (with no rows) if this rank's sample() never called `entropy_fn`."""
        if self.synced and not self.rounds:
            self(sampled.select(torch.zeros(0, dtype=torch.long)))

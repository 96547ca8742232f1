"""ReplayMixin: what `ReplayCallback` needs from a GRPO LightningModule, derived from the module's policy.

    class MyGRPO(ReplayMixin, LightningModule): ...

The callback rescores stored trajectories with the current policy (the paper's trajectory selection) through
`score_entropy`, and under ZeRO-3/FSDP asks `entropy_forwards` how many policy forwards that takes, so that
every rank runs the same number. The mixin implements both with `exgrpo_pl.step.rollout.score_entropy` on the
module's transformers policy; override `replay_policy` if yours is not `self.policy` or `self.model`.

Three more methods make a GRPO `training_step` honour `batch["experience"]` in a few lines
(examples/own_module.py, docs/replay_contract.md): `replay_groups` (what to train on, sampled with your
own sampler), `record_behaviour` (the fresh rows' behaviour log-probs and entropy from your first
forward) and `replay_loss` (the replayed rows' importance-weighted loss terms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.lightning_internals import attached_trainer
from exgrpo_pl.step.groups import record_behaviour, replayed_token_loss, sample_groups
from exgrpo_pl.step.logprobs import DEFAULT_CHUNK_ELEMENTS
from exgrpo_pl.step.rollout import num_micro_batches, score_entropy
from exgrpo_pl.step.update import sum_over_ranks


class ReplayMixin:
    """`score_entropy` and `entropy_forwards` of `exgrpo_pl.contract.ReplayableModule`, from the policy.

    Reads, when the module has them: `hparams.temperature` (the sampling temperature, default 1.0),
    `hparams.micro_batch_size` (rows per training forward, hence per rescoring forward),
    `hparams.logit_chunk_elements` (logits per float32 chunk of the softmax work, default
    `exgrpo_pl.step.logprobs.DEFAULT_CHUNK_ELEMENTS`), `tokenizer.pad_token_id` (the token of ZeRO-3's padding
    forwards, default 0). The module must also have `num_generations` (K).

    Rescoring runs without gradients, so a forward of as many rows as a training forward needs less memory
    than it: without `micro_batch_size` (a training forward takes the whole batch, at least K rows) a
    rescoring forward takes K rows. Memory is then bounded by the training step's, however many stored
    trajectories are rescored.
    """

    def replay_policy(self):
        """The causal LM whose entropy ranks stored trajectories: `self.policy`, else `self.model`."""
        for name in ("policy", "model"):
            policy = getattr(self, name, None)
            if policy is not None:
                return policy
        raise AttributeError(
            f"{type(self).__name__} has neither `policy` nor `model`: override ReplayMixin.replay_policy() "
            "to return the causal LM that samples rollouts"
        )

    def _replay_setting(self, name: str, default):
        value = getattr(getattr(self, "hparams", None), name, None)
        return default if value is None else value

    def score_entropy(self, rollouts: RolloutBatch, num_forwards: int | None = None) -> Tensor:
        """`[N]` mean completion-token entropy under the current policy (the paper's trajectory selection).

        `num_forwards`: run exactly that many forwards (see `exgrpo_pl.contract.ReplayableModule`).
        """
        tokenizer = getattr(self, "tokenizer", None)
        return score_entropy(
            self.replay_policy(),
            rollouts.to(self.device),
            self._replay_setting("temperature", 1.0),
            self.rescore_rows(),
            num_forwards=num_forwards,
            pad_token_id=getattr(tokenizer, "pad_token_id", None) or 0,
            chunk_elements=self._replay_setting("logit_chunk_elements", DEFAULT_CHUNK_ELEMENTS),
        )

    def entropy_forwards(self, rollouts: RolloutBatch) -> int:
        """Policy forwards that `score_entropy(rollouts)` runs: one per micro-batch."""
        return num_micro_batches(len(rollouts), self.rescore_rows())

    def rescore_rows(self) -> int:
        """Rows per rescoring forward: the training `micro_batch_size`, else K (`num_generations`)."""
        return self._replay_setting("micro_batch_size", self.num_generations)

    # ------------------------------------------------------------- a replay-ready training_step
    def replay_groups(self, batch: dict, rollout_fn: Callable[..., Sequence]) -> RolloutBatch:
        """The rows this step trains on, `batch["experience"]` honoured, with advantages, on `self.device`.

        `exgrpo_pl.step.groups.sample_groups` with K = `num_generations`, `global_step` as the policy version,
        and `hparams.scale_rewards` ("group") and `hparams.correct_threshold` (0.5) when the module has them.
        Under data parallelism "batch" scaling divides by the std of every rank's rewards (an all-reduce).

        Args:
            batch: the training batch.
            rollout_fn: `rollout_fn(prompts, **columns) -> (prompt_ids, prompt_mask, completion_ids,
                completion_mask, rewards[, completions])`, one scored completion per prompt entry.
        """
        rollouts = sample_groups(
            batch, self.num_generations, rollout_fn,
            scale_rewards=self._replay_setting("scale_rewards", "group"), policy_version=self.global_step,
            correct_threshold=self._replay_setting("correct_threshold", 0.5),
            sum_over_ranks=partial(sum_over_ranks, attached_trainer(self)),  # "batch": every rank's std
        )  # fmt: skip
        experience = batch.get("experience")
        self._unweighted_replayed_rows = 0 if experience is None else len(experience.rollouts)
        return rollouts.to(self.device)

    def unweighted_replayed_rows(self) -> int:
        """Replayed rows the latest `replay_groups` returned that no `replay_loss` call has weighted since.

        `ReplayCallback` stops a replay step after which this is not 0: those rows were trained with the
        module's on-policy term, as if the current policy had sampled them.
        """
        return getattr(self, "_unweighted_replayed_rows", 0)

    def record_behaviour(
        self, rollouts: RolloutBatch, logps: Tensor, logits: Tensor, rows: slice = slice(None)
    ) -> None:
        """The fresh rows' behaviour log-probs and entropy from this batch's first forward (in place).

        See `exgrpo_pl.step.groups.record_behaviour`: `logps` `[n, C]`, `logits` `[n, C, V]` (or token
        entropies `[n, C]`) of the forward taken before any update on this batch; `rows`, the rows of
        `rollouts` a micro-batched forward took (default: all).
        """
        record_behaviour(rollouts, logps, logits, rows)

    def replay_loss(
        self, per_token: Tensor, logps: Tensor, rollouts: RolloutBatch, rows: slice = slice(None)
    ) -> Tensor:
        """`per_token` `[n, C]` with the replayed rows' terms replaced by -f(w) A (ExGRPO's off-policy term).

        See `exgrpo_pl.step.groups.replayed_token_loss`; reads `hparams.off_policy_correction` ("shaping"),
        `hparams.shaping_beta` (0.1) and `hparams.is_truncation` (2.0) when the module has them. With
        replayed rows it logs `train/is_weight`, their mean f(w), as `ExGRPOModule` does. `rows`: the rows of
        `rollouts` that `per_token` and `logps` are of, for a micro-batch (default: all).
        """
        self._unweighted_replayed_rows = 0
        stats: dict[str, Tensor] = {}
        per_token = replayed_token_loss(
            per_token, logps, rollouts, self._replay_setting("off_policy_correction", "shaping"),
            self._replay_setting("shaping_beta", 0.1), self._replay_setting("is_truncation", 2.0), stats,
            rows,
        )  # fmt: skip
        if stats and attached_trainer(self) is not None:
            is_weight = stats["is_weight"]
            self.log("train/is_weight", is_weight, on_step=True, on_epoch=False, batch_size=len(per_token))
        return per_token

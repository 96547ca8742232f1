"""The optimisation half of a GRPO step: micro-batched forwards and backwards, clipping, and the step itself.

`ExGRPOModule` trains each step's groups (`exgrpo_pl.step.groups.assemble_groups`) with its `update_policy`
(`PolicyUpdate`), which runs `num_iterations` passes over them of `steps_per_generation` optimizer updates
each (one per mini-batch). The loss is
`exgrpo_pl.step.losses.compute_grpo_loss`: the clipped ratio on fresh rows, f(w) = w / (w + beta) on replayed
ones. An update whose loss or gradient norm is NaN or infinite is skipped, so a bad batch never reaches the
weights (`NonFiniteGuard`), and so is one whose gradient norm exceeds `skip_grad_norm` when set (the official
ExGRPO code's rule).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.engines.generation import completion_mask_from_ids
from exgrpo_pl.step.forward import record_behaviour
from exgrpo_pl.step.losses import (
    LossNormaliser,
    compute_grpo_loss,
    compute_importance_weights,
    official_micro_batches,
)
from exgrpo_pl.step.mini_batches import accumulate, averaged, mini_batch_rows
from exgrpo_pl.step.rollout import completion_logps


class NonFiniteGuard:
    """Counts updates skipped for a non-finite loss or gradient norm; too many in a row stop the run.

    Under fp16 loss scaling (`16-mixed`, DeepSpeed fp16) a gradient overflow is the loss scaler's business: it
    skips that update and lowers its scale, and the first steps of a run overflow that way by design. Such a
    skip is counted, but not towards the limit (a non-finite loss still is).

    Args:
        max_in_a_row: skipped updates in a row that raise.
    """

    def __init__(self, max_in_a_row: int) -> None:
        self.max_in_a_row = max_in_a_row
        self.skipped = 0
        self.in_a_row = 0
        self.too_large = 0  # finite updates skipped for a gradient norm above `skip_grad_norm`

    def passed(self) -> None:
        self.in_a_row = 0

    def skip_too_large(self, step: int, grad_norm: float, limit: float) -> None:
        """Counts a finite update skipped for its gradient norm; as in the official ExGRPO code, however many
        in a row, the run goes on (they are not non-finite)."""
        self.too_large += 1
        rank_zero_info(f"step {step}: gradient norm {grad_norm:.4g} > skip_grad_norm={limit}; update skipped")

    def skip(self, step: int, loss: float, grad_norm: float | None, scaler_overflow: bool = False) -> None:
        self.skipped += 1
        if scaler_overflow:
            rank_zero_info(
                f"step {step}: gradient overflow; the loss scaler skipped the update and lowers its scale"
            )
            return
        self.in_a_row += 1
        if self.in_a_row >= self.max_in_a_row:
            raise RuntimeError(
                f"{self.in_a_row} updates in a row had a non-finite loss or gradient norm (last: loss "
                f"{loss}, grad_norm {grad_norm}) and were skipped; the weights are those of step {step}. "
                "Lower model.learning_rate, check the reward functions' values, or raise "
                "model.max_nonfinite_steps"
            )
        rank_zero_info(f"step {step}: non-finite loss or gradient norm; update skipped")


class PolicyUpdate:
    """The optimisation half of `ExGRPOModule`'s step, as its method `update_policy`.

    Reads from the module: `hparams` (the loss and optimisation options), `policy`, `reference` and
    `lora_config` (the KL reference), `eos_token_ids`, `engine` (told when the weights change), `nonfinite`
    (a `NonFiniteGuard`), and Lightning's optimizer, scheduler, strategy and precision plugin.
    """

    def update_policy(self, rollouts: RolloutBatch) -> dict[str, Tensor]:
        """`num_iterations` passes over `rollouts`, each `steps_per_generation` optimizer steps (one per
        mini-batch of its groups, `mini_batch_rows`), accumulated over micro-batches.

        The forward pass of each row taken before any update gives the fresh rows their behaviour log-probs
        and entropy (`record_behaviour`: what the buffer stores) and the old log-probs of the clipped ratio:
        the first pass's own forwards with one mini-batch, a forward of every row without gradients first
        with several (a later mini-batch's old log-probs must be those of the policy that sampled it, as the
        official ExGRPO code computes them before its updates). Each update's loss is normalised by its own
        mini-batch (`LossNormaliser`). Every rank leaves a non-finite update at the same micro-batch (its
        finiteness is all-reduced), so no backward waits on another rank.

        Args:
            rollouts: the step's groups, with advantages.

        Returns:
            Detached statistics: loss, clip_ratio, is_weight, kl (means over the step's updates), grad_norm
                (of the last update), nonfinite_steps, and replayed_share (the share of the step's
                policy-gradient weight on this rank that came from replayed rows, `compute_grpo_loss`'s
                `weigh_replayed`; 0 on a step that replays nothing once replay has started, absent
                before); loss is NaN when an update was skipped. Under data
                parallelism the loss is this rank's share of the whole batch's loss times the number of
                ranks (`LossNormaliser`): its mean over the ranks is the batch's loss.
        """
        hp = self.hparams
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss_mask = rollouts.completion_mask
        if hp.mask_truncated_completions:
            _, truncated = completion_mask_from_ids(rollouts.completion_ids, self.eos_token_ids)
            loss_mask = loss_mask & ~truncated.unsqueeze(1)
        stored_only = rollouts.group_size == 1  # a swap replay step: stored rows, no groups
        updates = mini_batch_rows(len(rollouts), self.num_generations, hp.steps_per_generation, stored_only)
        updates = [rows.to(loss_mask.device) for rows in updates]
        normalisers = [self.loss_normaliser(len(rows), loss_mask[rows]) for rows in updates]
        entropy_counts = self.entropy_counts(rollouts, updates)
        old_logps = torch.zeros_like(rollouts.behaviour_logps)
        size = hp.micro_batch_size or len(rollouts)
        scored_first = len(updates) > 1
        if scored_first:
            self._score_before_updates(rollouts, old_logps, size)
        # The official code's `loss_remove_clip`: fresh rows unclipped once replay has started.
        clip = hp.clip_after_replay_starts or not self.replay_started()
        weight = 1.0 / (hp.num_iterations * len(updates))  # each update's share of the step's statistics
        weigh_replayed = bool(rollouts.replayed.any())
        totals: dict[str, float] = {}
        shares: dict[str, float] = {}  # per averaged statistic, the share of the step that reported it
        finite = True
        for iteration in range(hp.num_iterations):
            for update_rows, normaliser, entropy_count in zip(updates, normalisers, entropy_counts):
                for rows in update_rows.split(size):
                    logps, entropy = self._forward(rollouts, rows, with_entropy=True)
                    if iteration == 0 and not scored_first:
                        old_logps[rows] = logps.detach()
                        record_behaviour(rollouts, logps, entropy, rows)
                    weights = None
                    if bool(rollouts.replayed[rows].any()):
                        weights = compute_importance_weights(
                            logps, rollouts.behaviour_logps[rows], rollouts.completion_mask[rows],
                            hp.off_policy_correction, hp.shaping_beta, hp.is_truncation,
                            hp.importance_sampling_level,
                        )  # fmt: skip
                    loss, stats = compute_grpo_loss(
                        logps, old_logps[rows], rollouts.advantages[rows], loss_mask[rows], normaliser,
                        importance_weights=weights, replayed=rollouts.replayed[rows],
                        ref_logps=self.reference_logps(rollouts, rows), entropy=entropy, clip=clip,
                        weigh_replayed=weigh_replayed, **loss_options(hp, entropy_count),
                    )  # fmt: skip
                    finite = self._finite_on_every_rank(loss)
                    if not finite:
                        break
                    self._count_micro_step()
                    self.manual_backward(loss)
                    share = weight * len(rows) / len(update_rows)
                    accumulate(totals, shares, {"loss": loss.detach(), **stats}, weight, share)
                finite = self._optimizer_step(optimizer, scheduler, finite, totals)
                if not finite:
                    break
            if not finite:  # the batch's remaining updates would start from the same weights
                break
        if finite:
            self.nonfinite.passed()
        averaged(totals, shares)
        totals["nonfinite_steps"] = float(self.nonfinite.skipped)
        if hp.skip_grad_norm is not None:
            totals["grad_norm_skips"] = float(self.nonfinite.too_large)
        if "pg_weight" in totals:
            replayed, every = totals.pop("replayed_pg_weight"), totals.pop("pg_weight")
            totals["replayed_share"] = replayed / every if every > 0 else 0.0
        elif self.replay_started():
            totals["replayed_share"] = 0.0
        return {key: torch.as_tensor(value) for key, value in totals.items()}

    def _optimizer_step(self, optimizer, scheduler, finite: bool, totals: dict[str, float]) -> bool:
        """Clip and apply the accumulated gradients, or skip a non-finite update (counted by `nonfinite`);
        returns whether the update was applied."""
        loss_finite = finite
        grad_norm = self._clip_gradients(optimizer) if finite else math.nan
        finite = finite and (grad_norm is None or math.isfinite(grad_norm))
        limit = self.hparams.skip_grad_norm
        if finite and limit is not None and grad_norm is not None and grad_norm > limit:
            # Every rank measured the same all-reduced gradients, so every rank skips this update. Without
            # gradients AdamW's step changes nothing and Lightning counts it: max_steps and the schedule go on
            # as the official code's do; a loss scaler refuses a step without gradients (then not counted).
            optimizer.zero_grad(set_to_none=True)
            self.nonfinite.skip_too_large(self.global_step, grad_norm, limit)
            if not self._loss_scaled():
                optimizer.step()
                scheduler.step()
            totals["grad_norm"] = grad_norm
            return True
        # A gradient overflow is the loss scaler's to skip.
        scaler_decides = loss_finite and self._loss_scaled()
        if finite or scaler_decides:
            optimizer.step()  # a loss scaler skips a step with inf gradients itself, and lowers its scale
        engine = self._deepspeed_engine()
        if engine is not None and finite:  # DeepSpeed checks the gradients inside its step
            finite = engine.was_step_applied()
            grad_norm = float(engine.get_global_grad_norm() or 0.0) if finite else math.inf
        if not finite:
            optimizer.zero_grad(set_to_none=True)
            self.nonfinite.skip(self.global_step, totals.get("loss", math.nan), grad_norm, scaler_decides)
            totals.update(loss=math.nan, grad_norm=grad_norm)
            return False
        self.engine.weights_changed()
        scheduler.step()
        totals["grad_norm"] = grad_norm
        optimizer.zero_grad(set_to_none=True)
        return True

    def _forward(
        self, rollouts: RolloutBatch, rows: Tensor, with_entropy: bool
    ) -> tuple[Tensor, Tensor | None]:
        """`[rows, C]` log-probs (and entropies) of the completions under the policy."""
        hp = self.hparams
        return completion_logps(
            self.policy, rollouts.prompt_ids[rows], rollouts.prompt_mask[rows], rollouts.completion_ids[rows],
            rollouts.completion_mask[rows], hp.temperature, with_entropy=with_entropy,
            chunk_elements=hp.logit_chunk_elements,
        )  # fmt: skip

    def entropy_counts(self, rollouts: RolloutBatch, updates: list[Tensor]) -> list[int]:
        """How many times each update's entropy bonus counts: once, or with `entropy_token_budget` the
        micro-batches the official ExGRPO code would split the update into, the largest over the ranks
        (`exgrpo_pl.step.losses.official_micro_batches`; one all-reduce)."""
        budget = self.hparams.entropy_token_budget
        if budget is None:
            return [1] * len(updates)
        tokens = rollouts.prompt_mask.sum(1) + rollouts.completion_mask.sum(1)  # [N]
        counts = official_micro_batches(torch.stack([tokens[rows].sum() for rows in updates]), budget)  # [U]
        if self.trainer.world_size > 1:
            counts = self.trainer.strategy.reduce(counts, reduce_op="max")
        return [int(count) for count in counts]

    def _score_before_updates(self, rollouts: RolloutBatch, old_logps: Tensor, size: int) -> None:
        """Old log-probs of every row, and the fresh rows' behaviour log-probs and entropy, from the policy
        before this step's first update (no gradients)."""
        with torch.no_grad():
            for rows in torch.arange(len(rollouts), device=old_logps.device).split(size):
                logps, entropy = self._forward(rollouts, rows, with_entropy=True)
                old_logps[rows] = logps
                record_behaviour(rollouts, logps, entropy, rows)

    def replay_started(self) -> bool:
        """Whether a replay callback of the trainer has begun its replay phase (`replay_active`, as
        `exgrpo_pl.callbacks.ReplayCallback` has), which the clipping schedule keys on."""
        trainer = self.trainer
        return any(
            callback.replay_active(trainer)
            for callback in trainer.callbacks
            if callable(getattr(callback, "replay_active", None))
        )

    def loss_normaliser(self, num_rows: int, loss_mask: Tensor) -> LossNormaliser:
        """The step's `LossNormaliser`: rows and loss tokens counted over every rank (one all-reduce)."""
        counts = torch.stack([torch.tensor(num_rows, device=loss_mask.device), loss_mask.sum()])  # [2]
        counts = self.sum_over_ranks(counts)
        num_sequences, num_tokens = (int(count) for count in counts)
        return LossNormaliser(
            num_sequences, num_tokens, self.hparams.max_completion_length, self.trainer.world_size
        )

    def sum_over_ranks(self, values: Tensor) -> Tensor:
        """`values` summed over every rank (`sum_over_ranks`)."""
        return sum_over_ranks(self.trainer, values)

    def reference_logps(self, rollouts: RolloutBatch, rows: Tensor) -> Tensor | None:
        """`[rows, C]` log-probs of the completions under the KL reference; None when beta is 0."""
        if self.hparams.beta == 0:
            return None
        # With LoRA the reference is the base model: the same weights with the adapter switched off.
        hp, lora = self.hparams, self.lora_config is not None
        reference = self.policy if lora else self.reference
        with torch.no_grad(), self.policy.disable_adapter() if lora else nullcontext():
            logps, _ = completion_logps(
                reference, rollouts.prompt_ids[rows], rollouts.prompt_mask[rows],
                rollouts.completion_ids[rows], rollouts.completion_mask[rows], hp.temperature,
                with_entropy=False, chunk_elements=hp.logit_chunk_elements,
            )  # fmt: skip
        return logps

    def _finite_on_every_rank(self, loss: Tensor) -> bool:
        """Whether the loss is finite on every rank (one all-reduce when there are several)."""
        finite = torch.isfinite(loss.detach()).float()
        if self.trainer.world_size > 1:
            finite = self.trainer.strategy.reduce(finite, reduce_op="min")
        return bool(finite)

    def _clip_gradients(self, optimizer) -> float | None:
        """Total gradient norm before clipping (TRL's grad_norm); clips when max_grad_norm > 0.

        Under DeepSpeed the engine owns the (sharded) gradients and clips inside its step with
        `gradient_clipping` (set from max_grad_norm by `check_strategy`): None here, read after the step.
        Under `16-mixed` the gradients are still multiplied by the loss scale here (Lightning unscales them
        inside `optimizer.step()`, and only once), so the norm is divided by it and the threshold multiplied.
        """
        if isinstance(self.trainer.strategy, DeepSpeedStrategy):
            return None
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) / scale if grads else 0.0
        limit = self.hparams.max_grad_norm
        if limit > 0 and math.isfinite(norm):
            self.clip_gradients(optimizer, gradient_clip_val=limit * scale, gradient_clip_algorithm="norm")
        return norm

    def _deepspeed_engine(self):
        """The DeepSpeed engine of the strategy, or None."""
        strategy = self.trainer.strategy
        return strategy.deepspeed_engine if isinstance(strategy, DeepSpeedStrategy) else None

    def _count_micro_step(self) -> None:
        """Makes the coming backward add to the step's gradient under ZeRO-3. There a backward's gradient
        partition replaces the one before unless the engine counted a micro-step in between, which it does at
        the start of each engine forward (DeepSpeed 0.19.8: `clear_backward_seen_flag` raises
        `micro_step_id` once a backward has run; `step()` sets it back to 0); this step runs all its
        micro-batches inside the one engine forward Lightning wraps around `training_step`, so it counts
        them here, as separate forwards would."""
        engine = self._deepspeed_engine()
        if engine is not None and engine.zero_optimization_stage() == 3:
            engine.optimizer.clear_backward_seen_flag()

    def _loss_scaled(self) -> bool:
        """Whether an fp16 loss scaler (torch's GradScaler under 16-mixed, DeepSpeed's) handles overflows."""
        engine = self._deepspeed_engine()
        if engine is not None:
            return bool(engine.fp16_enabled())
        return getattr(self.trainer.precision_plugin, "scaler", None) is not None


def sum_over_ranks(trainer, values: Tensor) -> Tensor:
    """`values` summed over every rank of `trainer` (an all-reduce on a copy, which every rank must reach);
    `values` itself on one rank or without a trainer."""
    if trainer is None or trainer.world_size == 1:
        return values
    return trainer.strategy.reduce(values.clone(), reduce_op="sum")


def loss_options(hp, entropy_count: int = 1) -> dict:
    """`compute_grpo_loss`'s keyword arguments from the module's options (`hparams`), the entropy bonus
    counted `entropy_count` times (`PolicyUpdate.entropy_counts`)."""
    return dict(
        loss_type=hp.loss_type,
        epsilon_low=hp.epsilon,
        # 0 is a setting (no reward for raising a token's probability), so only None means "= epsilon".
        epsilon_high=hp.epsilon if hp.epsilon_high is None else hp.epsilon_high,
        delta=hp.delta,
        importance_sampling_level=hp.importance_sampling_level,
        beta=hp.beta,
        use_bias_correction_kl=hp.use_bias_correction_kl,
        entropy_coef=hp.entropy_coef * entropy_count,
    )

"""ExGRPOModule: a complete GRPO trainer as a LightningModule, ready for ExGRPO's replay callback.

Alone it trains plain GRPO: K rollouts per prompt, verifiable rewards, group advantages, a clipped policy
gradient step. With `exgrpo_pl.callbacks.ReplayCallback` it trains ExGRPO: the callback puts replayed
experience into the batch and the module mixes it in (see `exgrpo_pl.contract`).

    exgrpo fit --config configs/quickstart.yaml
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from copy import deepcopy

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics import MeanMetric
from transformers import get_scheduler

from exgrpo_pl.batch import RolloutBatch, pad_sequences
from exgrpo_pl.contract import Experience
from exgrpo_pl.logging_steps import writes_step_metrics
from exgrpo_pl.losses import (
    LOSS_TYPES,
    OFF_POLICY_CORRECTIONS,
    SCALE_REWARDS,
    LossNormaliser,
    compute_grpo_loss,
    compute_importance_weights,
    group_advantages,
    masked_mean,
)
from exgrpo_pl.models import DTYPES, load_policy, load_tokenizer, lora_config
from exgrpo_pl.rewards import ArithmeticReward, compute_rewards
from exgrpo_pl.rollout import (
    completion_logps,
    completion_mask_from_ids,
    num_micro_batches,
    sample_completions,
    score_entropy,
)
from exgrpo_pl.strategies import check_strategy, hf_deepspeed_config, needs_synced_generation

# Batch keys the module consumes itself; every other list-valued key is a dataset column for the rewards.
_RESERVED_KEYS = ("prompt", "question_id", "experience")


class ExGRPOModule(LightningModule):
    """GRPO with manual optimization; ExGRPO when a `ReplayCallback` is attached.

    Args:
        model_name_or_path: local directory or hub id of a causal LM, or `embedded:tiny-arith`.
        reward_funcs: reward functions, TRL's protocol `fn(prompts, completions, **columns) -> list[float]`.
            Defaults to the synthetic task's exact verifier.
        reward_weights: one weight per reward function (default 1.0 each).
        num_generations: K, rollouts per prompt (>= 2: a group of one has no advantage).
        max_prompt_length: longest prompt in tokens; longer prompts are an error unless `truncate_prompts`.
        truncate_prompts: keep the last `max_prompt_length` tokens of a long prompt instead of failing.
        max_completion_length: generation budget in tokens.
        temperature: sampling temperature (> 0).
        top_p: nucleus sampling mass in (0, 1].
        loss_type: "grpo" (per-sequence mean), "dr_grpo" (constant normaliser), "dapo" (token mean).
        scale_rewards: divide advantages by the "group" std, the "batch" std, or "none".
        epsilon: lower clipping range of the ratio.
        epsilon_high: upper clipping range (DAPO's clip-higher); defaults to `epsilon`.
        num_iterations: optimizer updates per generated batch (old log-probs are kept from the first).
        beta: weight of the KL to a frozen reference; 0 builds no reference model.
        entropy_coef: weight of the entropy bonus (the paper uses 0.001).
        mask_truncated_completions: leave completions that hit the budget without EOS out of the loss.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps of the schedule.
        lr_scheduler_type: a transformers schedule name ("constant_with_warmup", "cosine", "linear", ...).
        max_grad_norm: gradient clipping by total norm; 0 disables it.
        micro_batch_size: rollouts per forward/backward (bounds activation memory); None = all at once.
        correct_threshold: a rollout is correct when its reward exceeds this.
        off_policy_correction: weight of replayed tokens: "shaping" (w / (w + shaping_beta)),
            "truncate" (min(w, is_truncation)) or "none" (w).
        shaping_beta: beta of policy shaping (paper: 0.1).
        is_truncation: cap of truncated importance sampling.
        val_temperature: sampling temperature of validation pass@1; None = `temperature`, 0 = greedy.
        val_num_generations: completions sampled per validation prompt; pass@1 is their mean correctness
            (more samples, less noise).
        validate_at_start: measure validation pass@1 once before the first update (logged at step 0), so
            every run shows where it started.
        chat_template: wrap each prompt as a user message with the tokenizer's chat template.
        dtype: parameter dtype of the policy ("float32", "bfloat16", "float16").
        attn_implementation: attention kernel passed to `from_pretrained`.
        gradient_checkpointing: recompute activations in backward to save memory.
        lora: train a LoRA adapter instead of all weights: keyword arguments of `peft.LoraConfig`, e.g.
            `{r: 16, lora_alpha: 32, target_modules: all-linear}` (needs the `peft` extra). The KL reference
            is then the base model with the adapter switched off, so no second copy is built.
    """

    def __init__(
        self,
        model_name_or_path: str = "embedded:tiny-arith",
        reward_funcs: list[Callable] | None = None,
        reward_weights: list[float] | None = None,
        num_generations: int = 8,
        max_prompt_length: int = 512,
        truncate_prompts: bool = False,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        num_iterations: int = 1,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        mask_truncated_completions: bool = False,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_scheduler_type: str = "constant_with_warmup",
        max_grad_norm: float = 1.0,
        micro_batch_size: int | None = None,
        correct_threshold: float = 0.5,
        off_policy_correction: str = "shaping",
        shaping_beta: float = 0.1,
        is_truncation: float = 2.0,
        val_temperature: float | None = None,
        val_num_generations: int = 1,
        validate_at_start: bool = False,
        chat_template: bool = False,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        lora: dict | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["reward_funcs"])
        _validate(self.hparams)
        self.automatic_optimization = False
        self.num_generations = num_generations
        self.reward_funcs = list(reward_funcs) if reward_funcs else [ArithmeticReward()]
        if reward_weights is not None and len(reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries for {len(self.reward_funcs)} reward_funcs"
            )
        self.reward_weights = reward_weights
        self.tokenizer = load_tokenizer(model_name_or_path)
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"chat_template=True but the tokenizer of {model_name_or_path!r} has no chat template"
            )
        self.lora_config = lora_config(lora) if lora else None
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = eos if isinstance(eos, list) else [eos]
        self.policy = None
        self.reference = None
        self.val_pass_at_1 = MeanMetric()
        self.test_pass_at_1 = MeanMetric()
        self.num_tokens = 0  # prompt + completion tokens trained on (TRL's num_tokens)
        self.generated_tokens = 0  # completion tokens sampled; replay saves these, so budgets compare on it
        # The last training step's seconds per phase ("timing/*") and per-function reward means, as floats:
        # logged on logging steps, readable on every step.
        self.last_step_metrics: dict[str, float] = {}

    # ----------------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        """Reject a strategy config that conflicts with the trainer or this module, before any training."""
        check_strategy(self.trainer, self, self.trainer.datamodule)

    def configure_model(self) -> None:
        """Build the policy (and the frozen reference when beta > 0) once, inside the strategy's context."""
        if self.policy is not None:
            return
        hp = self.hparams
        # Under ZeRO-3 transformers must know the model is partitioned while it loads the checkpoint; it
        # learns that from a live HfDeepSpeedConfig, kept as long as the model.
        self._hf_deepspeed = hf_deepspeed_config(self._trainer) if self._trainer is not None else None
        self.policy = load_policy(
            hp.model_name_or_path, hp.dtype, hp.attn_implementation, hp.gradient_checkpointing
        )
        self.policy.train()  # from_pretrained returns eval mode; training forwards must run in train mode
        if self.lora_config is not None:
            from peft import get_peft_model

            self.policy = get_peft_model(self.policy, self.lora_config)
        elif hp.beta > 0:
            self.reference = deepcopy(self.policy).eval().requires_grad_(False)

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches) * hp.num_iterations, 1)
        scheduler = get_scheduler(hp.lr_scheduler_type, optimizer, hp.warmup_steps, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------- the step
    def training_step(self, batch: dict, batch_idx: int) -> dict:
        started = time.perf_counter()
        # Step metrics gathered on the way: timings, and per-function reward means.
        metrics = {"timing/generation": 0.0, "timing/reward": 0.0}
        experience: Experience | None = batch.get("experience")
        if experience is not None and experience.mode == "swap":
            rollouts = experience.rollouts.to(self.device)
        else:
            replayed = experience.rollouts.to(self.device) if experience is not None else None
            rollouts = self._collect(batch, replayed, metrics)
        update_started = time.perf_counter()
        stats = self._update(rollouts)
        metrics["timing/forward_backward"] = time.perf_counter() - update_started
        self.last_step_metrics = metrics
        self._step_record = (rollouts, stats, metrics, time.perf_counter() - started)
        return {"loss": stats["loss"], "rollouts": rollouts}

    def on_train_batch_end(self, outputs: dict, batch: dict, batch_idx: int) -> None:
        # Logged here, not in training_step: this hook runs after every callback's, so a callback that stops
        # the run on this step (EarlyStopping, a token budget) has set `should_stop`, which makes Lightning
        # write this step; `writes_step_metrics` then says so.
        self._log_step(*self._step_record)

    def _collect(self, batch: dict, replayed: RolloutBatch | None, metrics: dict[str, float]) -> RolloutBatch:
        """Generate and score a batch; in mix mode each replayed question gets K-1 fresh rollouts."""
        k = self.num_generations
        n_replayed = len(replayed) if replayed is not None else 0
        n_fresh = max(len(batch["prompt"]) - n_replayed, 0)  # replayed questions take the batch's last places
        prompts = batch["prompt"][:n_fresh]
        prompt_rows = self._encode_prompts(prompts, batch["question_id"][:n_fresh])
        # Replayed questions carry only their answer and domain; other dataset columns are None for them.
        columns = {key: list(value[:n_fresh]) + [None] * n_replayed for key, value in _columns(batch).items()}
        question_ids = batch["question_id"][:n_fresh].to(self.device)
        repeats = [k] * n_fresh
        if n_replayed:
            prompt_rows += [
                row[mask] for row, mask in zip(replayed.prompt_ids.cpu(), replayed.prompt_mask.cpu())
            ]
            prompts = list(prompts) + replayed.prompts
            columns["answer"] = (
                columns.get("answer", [None] * (n_fresh + n_replayed))[:n_fresh] + replayed.answers
            )
            if replayed.domains is not None and "domain" in columns:
                columns["domain"][n_fresh:] = replayed.domains
            question_ids = torch.cat([question_ids, replayed.question_ids])
            repeats += [k - 1] * n_replayed

        fresh = self._generate(prompt_rows, prompts, columns, question_ids, repeats, metrics)
        if n_replayed:
            # Order: on-policy groups, then per replayed question its stored row followed by K-1 fresh rows.
            both = RolloutBatch.cat([fresh, replayed], group_size=1)
            order = list(range(n_fresh * k))
            for j in range(n_replayed):
                order.append(len(fresh) + j)
                start = n_fresh * k + j * (k - 1)
                order.extend(range(start, start + k - 1))
            rollouts = both.select(order, group_size=k)
        else:
            rollouts = fresh
            rollouts.group_size = k
        rollouts.advantages = group_advantages(rollouts.rewards, k, self.hparams.scale_rewards)
        return rollouts

    def _generate(self, prompt_rows, prompts, columns, question_ids, repeats, metrics) -> RolloutBatch:
        """Sample `repeats[i]` completions of prompt i and score them with the reward functions."""
        hp = self.hparams
        counts = torch.tensor(repeats, device=self.device)
        prompt_ids, prompt_mask = pad_sequences(
            [row for row, r in zip(prompt_rows, repeats) for _ in range(r)],
            left=True,
            pad_value=self.tokenizer.pad_token_id,
        )
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        started = time.perf_counter()
        completion_ids, completion_mask, _ = sample_completions(
            self.policy,
            prompt_ids,
            prompt_mask,
            max_new_tokens=hp.max_completion_length,
            temperature=hp.temperature,
            top_p=hp.top_p,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            synced_gpus=self._synced_generation(),
        )
        metrics["timing/generation"] = time.perf_counter() - started
        self.generated_tokens += int(completion_mask.sum())

        started = time.perf_counter()
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        row_prompts = [p for p, r in zip(prompts, repeats) for _ in range(r)]
        row_columns = {
            key: [v for v, r in zip(value, repeats) for _ in range(r)] for key, value in columns.items()
        }
        rewards, per_function = compute_rewards(
            self.reward_funcs, self.reward_weights, row_prompts, completions, row_columns
        )
        metrics["timing/reward"] = time.perf_counter() - started
        for name, values in per_function.items():
            metrics[f"train/rewards/{name}/mean"] = float(values.nanmean())

        n = prompt_ids.shape[0]
        rewards = rewards.to(self.device, torch.float32)
        zeros = torch.zeros(n, device=self.device)
        return RolloutBatch(
            question_ids=question_ids.repeat_interleave(counts),
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            behaviour_logps=torch.zeros(completion_ids.shape, device=self.device),  # filled by _update
            rewards=rewards,
            correct=rewards > hp.correct_threshold,
            entropy=zeros.clone(),  # filled by _update from the same forward pass
            advantages=zeros,
            policy_version=torch.full((n,), self.global_step, device=self.device, dtype=torch.long),
            replayed=torch.zeros(n, dtype=torch.bool, device=self.device),
            group_size=1,
            prompts=row_prompts,
            completions=completions,
            answers=[str(a) for a in row_columns.get("answer", [""] * n)],
            domains=row_columns.get("domain"),
        )

    def _update(self, rollouts: RolloutBatch) -> dict[str, Tensor]:
        """`num_iterations` optimizer steps on the batch, accumulated over micro-batches.

        The first forward pass of each row, taken before any update, gives the fresh rows their behaviour
        log-probs and entropy (what the buffer stores) and the old log-probs of the clipped ratio.
        """
        hp = self.hparams
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss_mask = rollouts.completion_mask
        if hp.mask_truncated_completions:
            _, truncated = completion_mask_from_ids(rollouts.completion_ids, self.eos_token_ids)
            loss_mask = loss_mask & ~truncated.unsqueeze(1)
        normaliser = LossNormaliser(len(rollouts), int(loss_mask.sum()), hp.max_completion_length)
        fresh = ~rollouts.replayed
        old_logps = torch.zeros_like(rollouts.behaviour_logps)
        size = hp.micro_batch_size or len(rollouts)
        totals: dict[str, float] = {}
        for iteration in range(hp.num_iterations):
            for start in range(0, len(rollouts), size):
                rows = slice(start, start + size)
                logps, entropy = completion_logps(
                    self.policy,
                    rollouts.prompt_ids[rows],
                    rollouts.prompt_mask[rows],
                    rollouts.completion_ids[rows],
                    rollouts.completion_mask[rows],
                    hp.temperature,
                )
                if iteration == 0:
                    old_logps[rows] = logps.detach()
                    keep = fresh[rows].unsqueeze(1)
                    scored = logps.detach().masked_fill(~rollouts.completion_mask[rows], 0.0)
                    rollouts.behaviour_logps[rows] = torch.where(keep, scored, rollouts.behaviour_logps[rows])
                    row_entropy = masked_mean(entropy.detach(), rollouts.completion_mask[rows], dim=1)
                    rollouts.entropy[rows] = torch.where(fresh[rows], row_entropy, rollouts.entropy[rows])
                loss, stats = compute_grpo_loss(
                    logps,
                    old_logps[rows],
                    rollouts.advantages[rows],
                    loss_mask[rows],
                    normaliser,
                    loss_type=hp.loss_type,
                    epsilon_low=hp.epsilon,
                    epsilon_high=hp.epsilon_high or hp.epsilon,
                    importance_weights=self._importance_weights(logps, rollouts, rows),
                    replayed=rollouts.replayed[rows],
                    ref_logps=self._reference_logps(rollouts, rows),
                    beta=hp.beta,
                    entropy=entropy,
                    entropy_coef=hp.entropy_coef,
                )
                self.manual_backward(loss)
                share = min(size, len(rollouts) - start) / len(rollouts)
                _accumulate(totals, {"loss": loss.detach(), **stats}, share)
            grad_norm = self._clip_gradients(optimizer)
            optimizer.step()
            if grad_norm is None:
                grad_norm = float(self.trainer.strategy.deepspeed_engine.get_global_grad_norm() or 0.0)
            totals["grad_norm"] = grad_norm
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        self.num_tokens += int(rollouts.prompt_mask.sum() + rollouts.completion_mask.sum())
        return {key: torch.as_tensor(value) for key, value in totals.items()}

    def _importance_weights(self, logps: Tensor, rollouts: RolloutBatch, rows: slice) -> Tensor | None:
        if not bool(rollouts.replayed[rows].any()):
            return None
        hp = self.hparams
        return compute_importance_weights(
            logps,
            rollouts.behaviour_logps[rows],
            rollouts.completion_mask[rows],
            hp.off_policy_correction,
            hp.shaping_beta,
            hp.is_truncation,
        )

    def _reference_logps(self, rollouts: RolloutBatch, rows: slice) -> Tensor | None:
        if self.hparams.beta == 0:
            return None
        # With LoRA the reference is the base model: the same weights with the adapter switched off.
        reference = self.reference if self.lora_config is None else self.policy
        adapter_off = self.policy.disable_adapter() if self.lora_config is not None else nullcontext()
        with torch.no_grad(), adapter_off:
            logps, _ = completion_logps(
                reference,
                rollouts.prompt_ids[rows],
                rollouts.prompt_mask[rows],
                rollouts.completion_ids[rows],
                rollouts.completion_mask[rows],
                self.hparams.temperature,
                with_entropy=False,
            )
        return logps

    def _clip_gradients(self, optimizer) -> float | None:
        """Total gradient norm before clipping (TRL's grad_norm); clips when max_grad_norm > 0.

        Under DeepSpeed the engine owns the (sharded) gradients and clips inside its step with
        `gradient_clipping` (set from max_grad_norm by `check_strategy`): None here, read after the step.
        """
        if isinstance(self.trainer.strategy, DeepSpeedStrategy):
            return None
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if self.hparams.max_grad_norm > 0:
            self.clip_gradients(
                optimizer, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm"
            )
        return norm

    # ------------------------------------------------------------------------------------ helpers
    def _encode_prompts(self, prompts: list[str], question_ids: Tensor) -> list[Tensor]:
        """Token ids of each prompt; too long is an error naming the question, unless truncation is on."""
        hp = self.hparams
        if hp.chat_template:
            prompts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
                )
                for p in prompts
            ]
        encoded = self.tokenizer(list(prompts), add_special_tokens=not hp.chat_template)["input_ids"]
        rows = []
        for ids, prompt, qid in zip(encoded, prompts, question_ids.tolist()):
            if len(ids) > hp.max_prompt_length:
                if not hp.truncate_prompts:
                    raise ValueError(
                        f"prompt of question_id={qid} has {len(ids)} tokens > max_prompt_length="
                        f"{hp.max_prompt_length} (truncate_prompts: true keeps the end): {prompt[:60]!r}"
                    )
                ids = ids[-hp.max_prompt_length :]
            rows.append(torch.tensor(ids, dtype=torch.long))
        return rows

    def _synced_generation(self) -> bool:
        """Under ZeRO-3 every rank must keep stepping `generate` until all are done, or ranks deadlock."""
        return self._trainer is not None and needs_synced_generation(self._trainer)

    def score_entropy(self, rollouts: RolloutBatch, num_forwards: int | None = None) -> Tensor:
        """`[N]` mean completion-token entropy under the current policy (the paper's trajectory selection).

        `num_forwards`: run exactly that many forwards (see `exgrpo_pl.contract.ReplayableModule`).
        """
        return score_entropy(
            self.policy,
            rollouts.to(self.device),
            self.hparams.temperature,
            self._entropy_micro_batch_size(),
            num_forwards=num_forwards,
            pad_token_id=self.tokenizer.pad_token_id,
        )

    def entropy_forwards(self, rollouts: RolloutBatch) -> int:
        """Policy forwards that `score_entropy(rollouts)` runs: one per micro-batch."""
        return num_micro_batches(len(rollouts), self._entropy_micro_batch_size())

    def _entropy_micro_batch_size(self) -> int:
        return self.hparams.micro_batch_size or 64

    def _log_step(
        self, rollouts: RolloutBatch, stats: dict[str, Tensor], metrics: dict, step_time: float
    ) -> None:
        reward, pass_rate = rollouts.rewards.mean(), rollouts.correct.float().mean()
        if self.trainer.progress_bar_callback is not None:  # each `self.log` costs about a millisecond
            self.log("reward", reward, prog_bar=True, logger=False, batch_size=len(rollouts))
            self.log("pass@1", pass_rate, prog_bar=True, logger=False, batch_size=len(rollouts))
        if not writes_step_metrics(self.trainer):  # the full set only when a logger will see it
            return
        lengths = rollouts.completion_lengths.float()
        _, truncated = completion_mask_from_ids(rollouts.completion_ids, self.eos_token_ids)
        metrics = {
            **{key: torch.tensor(value) for key, value in metrics.items()},
            "train/reward": reward,
            "train/pass@1": pass_rate,
            "train/completions/mean_length": lengths.mean(),
            "train/completions/clipped_ratio": truncated.float().mean(),
            "train/entropy": rollouts.entropy.mean(),
            "train/learning_rate": torch.tensor(self.optimizers().param_groups[0]["lr"]),
            "train/num_tokens": torch.tensor(float(self.num_tokens)),
            "train/generated_tokens": torch.tensor(float(self.generated_tokens)),
            "train/step_time": torch.tensor(step_time),
            **{f"train/{key}": value for key, value in stats.items()},
        }
        if rollouts.group_size > 1:  # a swap batch has no groups
            group_std = rollouts.rewards.view(-1, rollouts.group_size).std(1)
            metrics["train/reward_std"] = group_std.mean()
            metrics["train/frac_reward_zero_std"] = (group_std == 0).float().mean()
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rollouts))

    # -------------------------------------------------------------------------------- evaluation
    def _pass_rate(self, batch: dict) -> Tensor:
        """`[B * n]` 1.0 where a completion sampled at `val_temperature` is correct, n per prompt."""
        hp = self.hparams
        n = hp.val_num_generations
        temperature = hp.temperature if hp.val_temperature is None else hp.val_temperature
        prompt_ids, prompt_mask = pad_sequences(
            [row for row in self._encode_prompts(batch["prompt"], batch["question_id"]) for _ in range(n)],
            left=True,
            pad_value=self.tokenizer.pad_token_id,
        )
        completion_ids, _, _ = sample_completions(
            self.policy,
            prompt_ids.to(self.device),
            prompt_mask.to(self.device),
            max_new_tokens=hp.max_completion_length,
            temperature=temperature,
            top_p=hp.top_p,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            synced_gpus=self._synced_generation(),
        )
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [p for p in batch["prompt"] for _ in range(n)]
        columns = {key: [v for v in value for _ in range(n)] for key, value in _columns(batch).items()}
        rewards, _ = compute_rewards(self.reward_funcs, self.reward_weights, prompts, completions, columns)
        return (rewards > hp.correct_threshold).float().to(self.device)

    def _evaluate(self, batch: dict, metric: MeanMetric, name: str) -> None:
        metric.update(self._pass_rate(batch))
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch["prompt"]))

    def on_train_start(self) -> None:
        if not self.hparams.validate_at_start or self.trainer.datamodule is None:
            return
        start = MeanMetric().to(self.device)
        for batch in self.trainer.datamodule.val_dataloader():
            start.update(self._pass_rate(batch))
        value = float(start.compute())
        if self.logger is not None:
            self.logger.log_metrics({"val/pass@1": value}, step=self.global_step)
        rank_zero_info(f"val/pass@1 before training: {value:.3f}")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, self.val_pass_at_1, "val/pass@1")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, self.test_pass_at_1, "test/pass@1")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["token_counts"] = {
            "num_tokens": self.num_tokens,
            "generated_tokens": self.generated_tokens,
        }
        # The sampling RNG, so that a resumed run generates what the uninterrupted run would have.
        checkpoint["sampling_rng"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        counts = checkpoint.get("token_counts", {})
        self.num_tokens = counts.get("num_tokens", 0)
        self.generated_tokens = counts.get("generated_tokens", 0)
        if "sampling_rng" in checkpoint:
            torch.set_rng_state(checkpoint["sampling_rng"])


def _columns(batch: dict) -> dict[str, list]:
    """The dataset columns of a batch that reward functions receive as keyword arguments."""
    return {
        key: list(value)
        for key, value in batch.items()
        if key not in _RESERVED_KEYS and isinstance(value, (list, tuple))
    }


def _accumulate(totals: dict[str, float], values: dict[str, Tensor], share: float) -> None:
    """Sum the loss over micro-batches (it is already normalised by the whole batch); average the rest."""
    for key, value in values.items():
        weight = 1.0 if key == "loss" else share
        totals[key] = totals.get(key, 0.0) + weight * float(value)


# (name, lowest allowed, whether the lowest is itself allowed); None values mean "use the default".
_LOWER_BOUNDS = [
    ("num_generations", 2, True),
    ("max_prompt_length", 1, True),
    ("max_completion_length", 1, True),
    ("temperature", 0.0, False),
    ("top_p", 0.0, False),
    ("epsilon", 0.0, True),
    ("epsilon_high", 0.0, True),
    ("num_iterations", 1, True),
    ("beta", 0.0, True),
    ("entropy_coef", 0.0, True),
    ("learning_rate", 0.0, False),
    ("warmup_steps", 0, True),
    ("max_grad_norm", 0.0, True),
    ("micro_batch_size", 1, True),
    ("shaping_beta", 0.0, False),
    ("is_truncation", 0.0, False),
    ("val_temperature", 0.0, True),
    ("val_num_generations", 1, True),
]
_CHOICES = {
    "loss_type": LOSS_TYPES,
    "scale_rewards": SCALE_REWARDS,
    "off_policy_correction": OFF_POLICY_CORRECTIONS,
    "dtype": tuple(DTYPES),
}


def _validate(hp) -> None:
    """Reject impossible settings at construction, i.e. before any training starts."""
    for name, low, inclusive in _LOWER_BOUNDS:
        value = hp[name]
        if value is not None and (value < low if inclusive else value <= low):
            raise ValueError(f"{name}={value}: must be {'>=' if inclusive else '>'} {low}")
    if hp.top_p > 1:
        raise ValueError(f"top_p={hp.top_p}: must be <= 1")
    for name, allowed in _CHOICES.items():
        if hp[name] not in allowed:
            raise ValueError(f"{name}={hp[name]!r}; allowed: {', '.join(allowed)}")

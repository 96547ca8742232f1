"""ExGRPOModule: a complete GRPO trainer as a LightningModule, ready for ExGRPO's replay callback.

Alone it trains plain GRPO: K rollouts per prompt, verifiable rewards, group advantages, a clipped policy
gradient step. With `exgrpo_pl.callbacks.ReplayCallback` it trains ExGRPO: the callback puts replayed
experience into the batch and the module mixes it in (`exgrpo_pl.step.groups`). A step reads top to bottom in
`training_step`: plan the rollouts (`exgrpo_pl.step.plan`), sample them with a rollout engine
(`exgrpo_pl.engines`) and score them (`RolloutCollector`, `exgrpo_pl.step.collect`), assemble the groups
(`exgrpo_pl.step.assembly`), update the policy (`PolicyUpdate`, `exgrpo_pl.step.update`). Its options are
checked in `exgrpo_pl.module.options`, its sampling and refill in `exgrpo_pl.module.sampling`
(`RolloutSampling`), its validation and test in `exgrpo_pl.module.evaluation`
(`PassRateEvaluation`), its checkpoint and resume hooks in `exgrpo_pl.module.resumable` (`ResumableModule`).

    exgrpo fit --config configs/quickstart.yaml
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from copy import deepcopy

import torch
from lightning.pytorch import LightningModule
from torchmetrics import MeanMetric
from transformers import get_scheduler

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.checkpoints.resume import estimated_stepping_batches
from exgrpo_pl.contract import PLACEMENTS
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.engines import build_engine
from exgrpo_pl.lightning_internals import attached_trainer, forget_step_metrics
from exgrpo_pl.models import completion_stop_ids, load_policy, load_tokenizer, lora_config, max_positions
from exgrpo_pl.module.evaluation import PassRateEvaluation
from exgrpo_pl.module.hparams_tab import log_run_hparams, run_hparams
from exgrpo_pl.module.logging_steps import step_metrics, writes_step_metrics
from exgrpo_pl.module.mixin import ReplayMixin
from exgrpo_pl.module.options import check_max_steps, check_options, stream_for_dynamic_sampling
from exgrpo_pl.module.resumable import ResumableModule
from exgrpo_pl.module.sampling import RolloutSampling
from exgrpo_pl.module.strategies import check_strategy, hf_deepspeed_config, needs_synced_generation
from exgrpo_pl.rewards import ArithmeticReward
from exgrpo_pl.step.collect import RolloutCollector
from exgrpo_pl.step.groups import assemble_groups, plan_rollouts
from exgrpo_pl.step.logprobs import DEFAULT_CHUNK_ELEMENTS
from exgrpo_pl.step.rollout_memory import check_evaluation_memory, check_rollout_memory
from exgrpo_pl.step.update import NonFiniteGuard, PolicyUpdate


class ExGRPOModule(
    ReplayMixin, RolloutSampling, PolicyUpdate, PassRateEvaluation, ResumableModule, LightningModule
):
    """GRPO with manual optimization; ExGRPO when a `ReplayCallback` is attached.

    Args:
        model_name_or_path: local directory or hub id of a causal LM, or `embedded:tiny-arith`.
        reward_funcs: reward functions, TRL's protocol `fn(prompts, completions, **kwargs) -> list[float]`
            (`completion_ids`, `trainer_state`, `log_metric`, `log_extra` and the dataset columns among the
            keyword arguments, `async def` allowed; see `exgrpo_pl.rewards.protocol`). Defaults to the
            synthetic task's exact verifier.
        reward_weights: one weight per reward function (default 1.0 each).
        reward_timeout_seconds: seconds one reward function may take per batch before the run stops with
            an error naming it (`exgrpo_pl.rewards.RewardTimeoutError`); None: no limit. Under a limit the
            functions run in a worker process, and `setup` checks that each can get there.
        num_generations: K, rollouts per prompt (>= 2: a group of one has no advantage).
        max_prompt_length: longest prompt in tokens; longer prompts are an error (found before training)
            unless `truncate_prompts`.
        truncate_prompts: keep the last `max_prompt_length` tokens of a long prompt instead of failing.
        max_completion_length: generation budget in tokens.
        temperature: sampling temperature (> 0).
        top_p: nucleus sampling mass in (0, 1].
        rollout_engine: what samples rollouts: "hf" (`model.generate`, runs everywhere) or "static" (a
            compiled static-cache decoder, much faster on a GPU), see `exgrpo_pl.engines`.
        rollout_engine_options: keyword arguments of the engine's class.
        loss_type: "grpo" (per-sequence mean), "dr_grpo" (constant normaliser), "dapo" (token mean); counted
            over every rank, so several ranks train on the gradient of their whole batch.
        scale_rewards: divide advantages by the "group" std, the "batch" std (of every rank's rewards), or
            "none".
        epsilon: lower clipping range of the ratio.
        epsilon_high: upper clipping range (DAPO's clip-higher); None: `epsilon` (0 is kept as 0).
        delta: two-sided clipping (INTELLECT-2): the unclipped ratio is capped at this (> 1); None: off.
            Fresh rows only: replayed rows are weighted by `off_policy_correction`.
        importance_sampling_level: "token" (a ratio per token) or "sequence" (GSPO: one length-normalised
            ratio per completion, for the clipped ratio and for replayed rows' w alike).
        num_iterations: passes over each generated batch (old log-probs are those before its first update).
        steps_per_generation: optimizer updates per pass (TRL's option of that name with its default
            `gradient_accumulation_steps=1`): the batch's groups are dealt out to this many mini-batches,
            each row used once, each update's loss normalised by its mini-batch. A generated batch then takes
            `num_iterations * steps_per_generation` optimizer steps, and Lightning's `global_step`,
            `max_steps` and the learning-rate schedule count those, not batches. The official ExGRPO script
            takes 2 (128 prompts, mini-batches of 64).
        clip_after_replay_starts: keep clipping fresh rows' ratio once a replay callback's replay phase has
            begun; False drops it then (the official ExGRPO code's `loss_remove_clip`), as its paper preset
            does. Replayed rows are never clipped, and before replay starts every row is.
        beta: weight of the KL to a frozen reference; 0 builds no reference model.
        use_bias_correction_kl: multiply each token's KL estimate by the importance ratio (TRL's default),
            which makes its gradient the unbiased reverse-KL gradient; only matters when beta > 0.
        entropy_coef: weight of the entropy bonus, subtracted times the mean token entropy of the whole
            batch whatever the loss type (the paper uses 0.001).
        entropy_token_budget: the official ExGRPO code's token budget per micro-batch (32768): the bonus then
            counts M times, M = ceil(an update's prompt + completion tokens on a rank / this), the largest
            over the ranks, as that code sums a token mean per micro-batch. None: once.
        mask_truncated_completions: leave completions that hit the budget without EOS out of the loss.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps of the schedule.
        lr_scheduler_type: a transformers schedule name ("constant_with_warmup", "cosine", "linear", ...).
        max_grad_norm: gradient clipping by total norm; 0 disables it.
        skip_grad_norm: an update whose gradient norm (before clipping) exceeds this is skipped, the run going
            on (the official ExGRPO code's rule, 500 on its loss); None: never. Not under DeepSpeed.
        max_nonfinite_steps: an update whose loss or gradient norm is NaN or infinite is skipped (the weights
            stay as they were, `train/nonfinite_steps` counts it); this many in a row stop the run. Under
            DeepSpeed, a step it skips counts too; under fp16 loss scaling a gradient overflow is left to the
            scaler (counted, not towards the limit).
        micro_batch_size: rollouts per forward/backward (bounds activation memory); None = all at once.
            Rescoring stored trajectories runs forwards of this many rows too (K when None).
        logit_chunk_elements: logits per float32 chunk of the log-prob and entropy work (training, reference
            and rescoring forwards): bounds its memory beyond the model's own logits.
        correct_threshold: a rollout is correct when its reward exceeds this.
        off_policy_correction: weight of replayed tokens: "shaping" (w / (w + shaping_beta)),
            "truncate" (min(w, is_truncation)) or "none" (w).
        shaping_beta: beta of policy shaping (paper: 0.1).
        is_truncation: cap of truncated importance sampling.
        val_temperature: sampling temperature of validation pass@1; None = `temperature`, 0 = greedy.
        val_num_generations: completions sampled per validation prompt; pass@1 is their mean correctness. A
            named evaluation set samples its own `num_samples` (or its file's repeats) instead.
        val_greedy: also sample one greedy completion of each problem of a named evaluation set, for its
            greedy pass@1.
        validate_at_start: measure validation pass@1 once before the first update (logged at step 0).
        chat_template: wrap each prompt as a user message with the tokenizer's chat template.
        stop_token_ids: token ids that end a completion besides the tokenizer's EOS, the generation config's
            `eos_token_id` and (with `chat_template`) the template's end-of-turn token, which always do.
        dtype: parameter dtype of the policy ("float32", "bfloat16", "float16").
        attn_implementation: attention kernel passed to `from_pretrained`.
        gradient_checkpointing: recompute activations in backward to save memory.
        lora: train a LoRA adapter instead of all weights: keyword arguments of `peft.LoraConfig`, e.g.
            `{r: 16, lora_alpha: 32, target_modules: all-linear}` (needs the `peft` extra). The KL reference
            is then the base model with the adapter switched off, so no second copy is built.
        dynamic_sampling: what fills the places of a step's dead groups (K equal rewards: no GRPO gradient)
            with fresh questions from the training stream, no replay involved: "off" (GRPO: they are trained
            on as they are); "refill" (one further round of as many fresh questions, K rollouts each, placed
            whatever their rewards: the twin of `ReplayCallback(placement="refill")`, which places replayed
            questions instead); "dapo" (DAPO's dynamic sampling, verl's `algorithm.filter_groups`: further
            rounds of a batch of fresh questions each, of which only groups with unequal rewards take places,
            until none is left or `max_generation_rounds`; then the rest stay as they are). Questions drawn
            count as seen: the next batch goes on after them, and resume stays exact. Needs a datamodule
            with `stream_passes()` and `draw_questions(n)` (`PromptDataModule`).
        refill_fraction: with dynamic_sampling "refill", the most places a step fills, as a share of its
            questions (at least one).
        max_generation_rounds: with dynamic_sampling "dapo", the most generation rounds a step takes, the
            first included (verl's `max_num_gen_batches`).
    """

    replay_placements = PLACEMENTS  # ReplayCallback(placement=...): refill happens in training_step

    def __init__(
        self,
        model_name_or_path: str = "embedded:tiny-arith",
        reward_funcs: list[Callable] | None = None,
        reward_weights: list[float] | None = None,
        reward_timeout_seconds: float | None = 600.0,
        num_generations: int = 8,
        max_prompt_length: int = 512,
        truncate_prompts: bool = False,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        rollout_engine: str = "hf",
        rollout_engine_options: dict | None = None,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        delta: float | None = None,
        importance_sampling_level: str = "token",
        num_iterations: int = 1,
        steps_per_generation: int = 1,
        clip_after_replay_starts: bool = True,
        beta: float = 0.0,
        use_bias_correction_kl: bool = True,
        entropy_coef: float = 0.0,
        entropy_token_budget: int | None = None,
        mask_truncated_completions: bool = False,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_scheduler_type: str = "constant_with_warmup",
        max_grad_norm: float = 1.0,
        skip_grad_norm: float | None = None,
        max_nonfinite_steps: int = 3,
        micro_batch_size: int | None = None,
        logit_chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        correct_threshold: float = 0.5,
        off_policy_correction: str = "shaping",
        shaping_beta: float = 0.1,
        is_truncation: float = 2.0,
        val_temperature: float | None = None,
        val_num_generations: int = 1,
        val_greedy: bool = False,
        validate_at_start: bool = False,
        chat_template: bool = False,
        stop_token_ids: list[int] | None = None,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        lora: dict | None = None,
        dynamic_sampling: str = "off",
        refill_fraction: float = 1.0,
        max_generation_rounds: int = 10,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["reward_funcs"])
        check_options(self.hparams)
        self.automatic_optimization = False
        self.num_generations = num_generations
        reward_funcs = list(reward_funcs) if reward_funcs else [ArithmeticReward()]
        if reward_weights is not None and len(reward_weights) != len(reward_funcs):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries for {len(reward_funcs)} reward_funcs"
            )
        self.tokenizer = load_tokenizer(model_name_or_path)
        if chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"chat_template=True but the tokenizer of {model_name_or_path!r} has no chat template"
            )
        self.collector = RolloutCollector(
            self.tokenizer, reward_funcs, reward_weights,
            max_prompt_length=max_prompt_length, truncate_prompts=truncate_prompts,
            chat_template=chat_template, correct_threshold=correct_threshold,
            reward_timeout_seconds=reward_timeout_seconds,
        )  # fmt: skip
        self.lora_config = lora_config(lora) if lora else None
        self.eos_token_ids = completion_stop_ids(
            self.tokenizer, model_name_or_path, stop_token_ids or (), chat_template
        )
        self.policy = self.reference = self.engine = None
        # pass@1 sums in float32 whatever the precision: `bf16-true` converts the module with `.to(dtype)`,
        # metric states included, and a bf16 sum stops counting at 256 (on_validation_start resets the dtype).
        self.val_pass_at_1 = MeanMetric()
        self.test_pass_at_1 = MeanMetric()
        self.num_tokens = 0  # prompt + completion tokens trained on (TRL's num_tokens)
        self.generated_tokens = 0  # completion tokens sampled; replay saves these, so budgets compare on it
        self.nonfinite = NonFiniteGuard(max_nonfinite_steps)
        # The last training step's seconds per phase ("timing/*") and per-function reward means, as floats:
        # logged on logging steps, readable on every step.
        self.last_step_metrics: dict[str, float] = {}
        self._total_steps: int | None = None  # the run's optimizer steps, once configure_optimizers knows

    # ----------------------------------------------------------------------------------------- setup
    def setup(self, stage: str) -> None:
        """Before any training or evaluation, before the model is loaded: reject a conflicting strategy
        config, sampling that cannot fit in memory, a reward function that cannot run where it will run, and
        prompts the tokenizer cannot encode or that are longer than allowed."""
        check_strategy(self.trainer, self, self.trainer.datamodule)
        if stage == "fit":
            check_max_steps(self.trainer.max_steps, self.hparams)
        self.collector.check_rewards()
        data = self.trainer.datamodule  # set up before the module (Lightning's order)
        if stage == "fit" and self.hparams.dynamic_sampling != "off":
            stream_for_dynamic_sampling(data, self.hparams.dynamic_sampling)
        if not isinstance(data, PromptDataModule):
            return
        hp = self.hparams
        self.collector.context_window = (hp.max_completion_length, max_positions(hp.model_name_or_path))
        device = self.trainer.strategy.root_device
        if stage == "fit":
            if data.hparams.batch_size < self.hparams.steps_per_generation:
                raise ValueError(
                    f"ExGRPOModule steps_per_generation={self.hparams.steps_per_generation}: more optimizer "
                    f"updates per batch than the batch's {data.hparams.batch_size} questions "
                    f"(data.batch_size); each update takes whole groups"
                )
            check_rollout_memory(self.hparams, data.hparams.batch_size, device)
            self.collector.check_prompts(data.train_rows, "training data", data.locate)
        sets = {None: [None] * len(data.val_rows)} if data.val_rows else {}
        sets.update({name: [row["num_samples"] for row in rows] for name, rows in data.eval_rows.items()})
        val_batch_size = data.hparams.val_batch_size or data.hparams.batch_size
        check_evaluation_memory(self.hparams, sets, val_batch_size, self.trainer.world_size, device)
        self.collector.check_prompts(data.val_rows, "validation data", data.locate)
        for name, rows in data.eval_rows.items():
            self.collector.check_prompts(rows, f"evaluation set {name!r}", data.locate)

    def configure_model(self) -> None:
        """Build the policy (and the frozen reference when beta > 0) once, inside the strategy's context."""
        if self.policy is not None:
            return
        hp = self.hparams
        # Under ZeRO-3 transformers must know the model is partitioned while it loads the checkpoint; it
        # learns that from a live HfDeepSpeedConfig, kept as long as the model.
        trainer = attached_trainer(self)
        self._hf_deepspeed = hf_deepspeed_config(trainer) if trainer is not None else None
        self.policy = load_policy(
            hp.model_name_or_path, hp.dtype, hp.attn_implementation, hp.gradient_checkpointing
        )
        self.policy.train()  # from_pretrained returns eval mode; training forwards must run in train mode
        if self.lora_config is not None:
            from peft import get_peft_model

            self.policy = get_peft_model(self.policy, self.lora_config)
        elif hp.beta > 0:
            self.reference = deepcopy(self.policy).eval().requires_grad_(False)
        sharded = trainer is not None and needs_synced_generation(trainer)
        self.engine = build_engine(hp.rollout_engine, self.policy, sharded, hp.rollout_engine_options)

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        # Not trainer.estimated_stepping_batches: it would set the training loader up before a resumed run's
        # checkpoint is restored, and the loader's saved position would never be loaded. It counts batches
        # (capped at max_steps), each taking `updates_per_batch` optimizer steps; max_steps counts those.
        total = int(estimated_stepping_batches(self.trainer)) * self.updates_per_batch
        total = max(min(total, self.trainer.max_steps) if self.trainer.max_steps != -1 else total, 1)
        self._total_steps = total
        scheduler = get_scheduler(hp.lr_scheduler_type, optimizer, hp.warmup_steps, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps (Lightning's `global_step`s) each generated batch takes."""
        return self.hparams.num_iterations * self.hparams.steps_per_generation

    # ------------------------------------------------------------------------------------- the step
    def training_step(self, batch: dict, batch_idx: int) -> dict:
        started = time.perf_counter()
        metrics = {"timing/generation": 0.0, "timing/reward": 0.0}
        plan = plan_rollouts(batch, self.num_generations)
        fresh = None
        if plan.mode != "swap":
            fresh, collected = self._collect(plan, self.hparams.temperature)
            self.generated_tokens += int(collected.pop("generated_tokens"))
            metrics.update(collected)
        # Under DDP "batch" scaling takes the std of every rank's rewards: every rank assembles each step.
        rollouts = assemble_groups(plan, fresh, self.hparams.scale_rewards, self.sum_over_ranks)
        gave_way = None
        if plan.mode != "swap":  # dead groups' places: refill's replayed questions, or dynamic sampling's
            rollouts, gave_way = self._fill_dead_groups(rollouts, batch.get("experience"), metrics)
        rollouts = rollouts.to(self.device)
        update_started = time.perf_counter()
        stats = self.update_policy(rollouts)
        metrics["timing/forward_backward"] = time.perf_counter() - update_started
        if math.isfinite(stats["loss"]):
            self.num_tokens += int(rollouts.prompt_mask.sum() + rollouts.completion_mask.sum())
        self.last_step_metrics = metrics
        self._step_record = (rollouts, stats, metrics, time.perf_counter() - started)
        # A skipped update never finished scoring its rows (behaviour log-probs, entropy): nothing to store.
        skipped = not math.isfinite(stats["loss"])
        return {"loss": stats["loss"], "rollouts": rollouts, "skipped": skipped, "gave_way": gave_way}

    def on_train_batch_end(self, outputs: dict, batch: dict, batch_idx: int) -> None:
        # Logged here, not in training_step: this hook runs after every callback's, so a callback that stops
        # the run on this step (EarlyStopping, a token budget) has set `should_stop`, which makes Lightning
        # write this step; `writes_step_metrics` then says so.
        self._log_step(*self._step_record)

    # --------------------------------------------------------------------------------- logging
    def _log_step(self, rollouts: RolloutBatch, stats: dict, timings: dict, step_time: float) -> None:
        fresh = ~rollouts.replayed  # rewards of fresh rows only (`step_metrics`): none on a swap replay step
        if self.trainer.progress_bar_callback is not None and bool(fresh.any()):  # a `self.log` costs ~1 ms
            rows = int(fresh.sum())
            self.log("reward", rollouts.rewards[fresh].mean(), prog_bar=True, logger=False, batch_size=rows)
            pass_rate = rollouts.correct[fresh].float().mean()
            self.log("pass@1", pass_rate, prog_bar=True, logger=False, batch_size=rows)
        if not writes_step_metrics(self.trainer):  # the full set only when a logger will see it
            return
        counters = {
            "learning_rate": self.optimizers().param_groups[0]["lr"],
            "num_tokens": self.num_tokens,
            "generated_tokens": self.generated_tokens,
            "step_time": step_time,
        }
        metrics = step_metrics(rollouts, self.eos_token_ids, {**stats, **counters}, timings)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rollouts))
        # What an earlier step logged and this one has not (its rewards, on a swap replay step) is not written
        # again with its last value.
        earlier = getattr(self, "_logged_step_metrics", set())
        forget_step_metrics(self.trainer, "on_train_batch_end", earlier - set(metrics))
        self._logged_step_metrics = set(metrics)

    # ------------------------------------------- resuming (ResumableModule), evaluation (PassRateEvaluation)
    def on_train_start(self) -> None:
        self._resume_on_train_start()
        log_run_hparams(self.trainer, run_hparams(self.hparams, self.trainer.callbacks))
        self._validate_at_start()

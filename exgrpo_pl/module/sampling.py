"""How `ExGRPOModule` samples and scores rollouts: its rollout engine's sampling settings, the reward
functions' `trainer_state`, the further rounds that fill dead groups (refill, dynamic sampling), and the
engine's warm-up when fitting starts
(`RolloutSampling`, a mixin of `ExGRPOModule`, beside `PolicyUpdate` and `PassRateEvaluation`)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.engines import SamplingConfig
from exgrpo_pl.step.groups import RolloutPlan, assemble_groups, plan_rollouts
from exgrpo_pl.step.losses import group_advantages
from exgrpo_pl.step.refill import dead_places, informative, placed, refill_plan, refilled


class RolloutSampling:
    """Sampling and scoring rollouts with the module's engine (`self.engine`) and collector
    (`self.collector`), under its options (`self.hparams`)."""

    def _collect(self, plan: RolloutPlan, temperature: float) -> tuple[RolloutBatch, dict[str, float]]:
        return self.collector.collect(
            self.engine, self._sampling(temperature), plan.prompts, plan.question_ids, plan.repeats,
            plan.columns, policy_version=self.global_step, device=self.device,
            trainer_state=self._trainer_state(),
        )  # fmt: skip

    def _trainer_state(self) -> SimpleNamespace:
        """The run's progress as reward functions receive it (`trainer_state`), under the names of TRL's
        `TrainerState`: `global_step` (optimizer steps taken), `epoch` (a float: epochs done, plus the part
        of this one), `max_steps` (the run's optimizer steps), `num_train_epochs`, `is_world_process_zero`
        and `is_local_process_zero`. A plain namespace, so that the worker process reads it without
        importing anything."""
        trainer = self.trainer
        batches = trainer.num_training_batches
        done = trainer.fit_loop.epoch_loop.batch_progress.current.ready - 1  # this batch is counted ready
        part = max(done, 0) / batches if trainer.training and 0 < batches < math.inf else 0.0
        return SimpleNamespace(
            global_step=self.global_step,
            epoch=self.current_epoch + part,
            max_steps=self._total_steps if self._total_steps is not None else trainer.max_steps,
            num_train_epochs=trainer.max_epochs,
            is_world_process_zero=trainer.is_global_zero,
            is_local_process_zero=trainer.local_rank == 0,
        )

    def _sampling(self, temperature: float) -> SamplingConfig:
        hp = self.hparams
        return SamplingConfig(
            hp.max_completion_length, temperature, hp.top_p, self.tokenizer.pad_token_id,
            tuple(self.eos_token_ids),
        )  # fmt: skip

    @override
    def on_fit_start(self) -> None:
        """Warm the rollout engine up (compile, allocate) on the run's widest training and validation calls.

        A compiling engine then does it here, timed, rather than inside the first step; prompt widths a run
        meets below `max_prompt_length` may still add a shape later.
        """
        data = self.trainer.datamodule
        if not isinstance(data, PromptDataModule):  # batch sizes unknown: the first calls compile
            return
        hp = self.hparams
        val_temperature = hp.temperature if hp.val_temperature is None else hp.val_temperature
        calls = [(data.hparams.batch_size * self.num_generations, hp.max_prompt_length, hp.temperature)]
        if data.val_rows:
            val_rows = (data.hparams.val_batch_size or data.hparams.batch_size) * hp.val_num_generations
            calls.append((val_rows, hp.max_prompt_length, val_temperature))
        started = time.perf_counter()
        # On its own generator states: a resumed run has restored the global ones already, and the warm-up's
        # sampling must not shift the rollouts that follow.
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            self.engine.warm_up([(rows, width, self._sampling(t)) for rows, width, t in calls])
        seconds = time.perf_counter() - started
        rank_zero_info(f"rollout engine {hp.rollout_engine!r} warmed up in {seconds:.1f} s")

    def _fill_dead_groups(self, rollouts: RolloutBatch, experience, metrics: dict) -> tuple:
        """(rows to train on, groups that gave way or None): the places of the step's dead groups (K equal
        rewards) filled by `exgrpo_pl.step.refill`, from replay's pool (`ReplayCallback(placement="refill")`)
        or from the training stream (`dynamic_sampling`), with as many rounds and places on every rank
        (generation is collective under ZeRO-3). Logs `train/dead_groups_before`, `train/dead_groups_after`
        and `train/generation_rounds` (this rank's groups; rounds including the first). Advantages follow
        `scale_rewards`, as the first round's do."""
        k, mode = self.num_generations, self.hparams.dynamic_sampling
        pool = experience.rollouts if experience is not None and experience.placement == "refill" else None
        places = dead_places(rollouts)
        metrics["train/dead_groups_before"] = float(places.sum())
        trained, gave_way, rounds = rollouts, [], 1
        if pool is not None or mode == "refill":  # one further round, placed whatever its rewards
            supply = (
                len(pool) if pool is not None else max(1, round(self.hparams.refill_fraction * len(places)))
            )
            n = self._same_on_every_rank(min(int(places.sum()), supply), "min")
            if n > 0:
                plan = refill_plan(pool, n, k) if pool is not None else self._fresh_plan(n)
                trained, gave = refilled(
                    rollouts, places, plan, self._collect_round(plan, metrics), self.hparams.scale_rewards,
                    self.sum_over_ranks,
                )  # fmt: skip
                gave_way, rounds = [gave], 2
        elif mode == "dapo":  # rounds of a batch of fresh questions; their informative groups take places
            while rounds < self.hparams.max_generation_rounds:
                if self._same_on_every_rank(int(places.sum()), "max") == 0:
                    break
                plan = self._fresh_plan(len(places))
                sampled = assemble_groups(plan, self._collect_round(plan, metrics), "none")
                chosen, left = informative(sampled, int(places.sum()))
                trained, gave = placed(trained, places, chosen)
                gave_way += [gave, left]
                places, rounds = dead_places(trained), rounds + 1
            if rounds > 1:
                trained.advantages = group_advantages(
                    trained.rewards, k, self.hparams.scale_rewards, sum_over_ranks=self.sum_over_ranks
                )
        metrics["train/dead_groups_after"] = float(dead_places(trained).sum())
        metrics["train/generation_rounds"] = float(rounds)
        return trained, (RolloutBatch.cat(gave_way, k) if gave_way else None)

    def _fresh_plan(self, n: int) -> RolloutPlan:
        """K rollouts of each of the training stream's next `n` questions (they count as seen)."""
        return plan_rollouts(self.trainer.datamodule.draw_questions(n), self.num_generations)

    def _collect_round(self, plan: RolloutPlan, metrics: dict) -> RolloutBatch:
        """A further generation round of `plan`, its tokens and seconds added to the step's."""
        fresh, collected = self._collect(plan, self.hparams.temperature)
        self.generated_tokens += int(collected["generated_tokens"])
        for key in ("timing/generation", "timing/reward"):
            metrics[key] += collected[key]
        return fresh

    def _same_on_every_rank(self, value: int, reduce_op: str) -> int:
        """`value` reduced over the ranks ("min" or "max"), so that every rank runs as many rounds."""
        if self.trainer.world_size == 1:
            return value
        return int(self.trainer.strategy.reduce(torch.tensor(value, device=self.device), reduce_op=reduce_op))

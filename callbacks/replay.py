"""ReplayCallback: turns a GRPO LightningModule into ExGRPO.

It decides when replay starts, fills the `TrajectoryBuffer` from every step's rollouts, and before each
step chooses between an on-policy batch and experience. Works with any module that follows
`exgrpo_pl.contract.ReplayableModule`, e.g. `ExGRPOModule`:

    trainer = Trainer(callbacks=[ReplayCallback(mode="mix", start_pass_rate=0.35)])
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from exgrpo_pl.callbacks import fill, module_checks, placement, replay_checks, replay_state
from exgrpo_pl.callbacks.collectives import all_ranks, min_across_ranks, union_across_ranks
from exgrpo_pl.callbacks.global_rng import global_rng_state, restore_global_rng_state
from exgrpo_pl.callbacks.replay_metrics import replay_metrics
from exgrpo_pl.callbacks.rescoring import Rescoring
from exgrpo_pl.checkpoints.resume import resumable_fit_progress, settle_resumed_step_count
from exgrpo_pl.contract import Experience, ReplayableModule
from exgrpo_pl.contract_checks import StepChecker
from exgrpo_pl.experience.buffer import TrajectoryBuffer
from exgrpo_pl.experience.replay import SelectiveReplay
from exgrpo_pl.module.logging_steps import writes_step_metrics
from exgrpo_pl.module.strategies import needs_synced_generation, zero_stage


class ReplayCallback(Callback):
    """Selective experience replay for GRPO (ExGRPO).

    Replay starts once every configured trigger holds (and then stays on): the epoch has reached
    `replay_start_epoch`, and a training batch's pass rate has exceeded `start_pass_rate`. From then on,
    each step replays with probability `replay.replay_probability`, provided the buffer holds at least
    `min_buffer_size` trajectories on every rank; otherwise the step stays on-policy and is counted in
    `replay/fallback_steps`. In swap mode, which generates nothing on a replay step, at most
    `max_consecutive_replay_steps` replay steps run in a row: the next step is fresh whatever the coin says
    (counted in `replay/forced_fresh_steps`), so new rollouts keep reaching the buffer and the bucketer. Every
    decision is taken identically on all ranks (a shared seeded coin and all-reduced conditions), since a
    rank that generates while another does not deadlocks under ZeRO-3.

    The paper's trajectory selection rescores stored trajectories with the policy, and each rank has its
    own buffer, so ranks have different numbers to rescore (or none). Under ZeRO-3 and FSDP, where every
    forward gathers parameter shards from all ranks, each replay step therefore runs one rescoring round on
    every rank: an all-reduce (max) of the ranks' forward counts, then that many forwards, padded with
    dummy ones. Under DDP nothing is added.

    The fresh questions a replay step displaces (a mixed step's last ones, as many as it replays; a swap
    step's whole batch) are dropped by default, as in the official code. With
    `displaced_questions="defer"` they come back first in the next batch instead (`PromptDataModule`'s
    training batches then form one stream of passes, see `PromptDataModule.stream_passes`), so every
    training question is still trained on once per pass, and a pass takes proportionally more steps. Every
    rank then displaces as many questions at each step (the fewest any rank replays: a rank with more
    replays only that many), so the ranks' streams reach each pass boundary, where retirement gathers across
    ranks, at the same step.

    Args:
        buffer: where trajectories are kept; default `TrajectoryBuffer()` (the reference description's
            defaults).
        replay: how experience is chosen; default `SelectiveReplay()` (the reference description's defaults).
        mode: "swap" (the reference description: with probability p the whole batch is replaced by B*K
            replayed trajectories and nothing is generated) or "mix" (the paper: a fraction `mix_fraction` of
            the batch's questions is replaced by experience, each as its stored trajectory plus K-1 fresh
            rollouts).
        mix_fraction: rho, share of a mixed batch's questions that come from experience (paper: 0.5).
        replay_start_epoch: first epoch that may replay (the reference description); None = no epoch
            condition.
        start_pass_rate: replay starts after a training batch's pass rate exceeds this (paper: 0.35);
            None = no pass-rate condition.
        min_buffer_size: fewest stored trajectories to replay from (the reference description: 1000).
        bounded_demand: mix mode: a step replays at most as many questions as the buffer holds in the
            medium-difficulty range (`replay.medium_range`), and the rest of the batch stays fresh, instead of
            drawing the rho share from wherever it can, which drains the medium tiers and then the tiers on
            either side when few questions arrive there per step. False replays the full share (the paper).
        displaced_questions: "discard" (the official code: the fresh questions a replay step displaces are not
            trained on in this pass) or "defer" (they come back first in the next batch, and the pass takes
            longer; needs a datamodule with `stream_passes()` and `defer_questions()`, as
            `PromptDataModule`). Under DDP, "defer" makes every rank replay the fewest questions any rank
            replays at that step.
        max_consecutive_replay_steps: swap mode: the most replay steps in a row; the step after them is
            fresh (its coin is still drawn, so every other decision stays the coin's). The default 4 keeps
            one step in five fresh at `replay_probability` 1, where without a floor nothing new would ever
            be generated, and at the reference description's 0.3 binds only after five heads in a row
            (probability 0.3^5 ~ 0.0024). Mix mode samples fresh rollouts on every step and ignores it.
        placement: mix mode: where experience goes (`exgrpo_pl.callbacks.placement`). "displace" (the paper):
            in place of the batch's last questions. "join": into the group of the batch's own question, as
            one of its K members (only questions the buffer already holds, so never on a single pass).
            "refill": in place of groups whose K rewards came out all equal, with K-1 rollouts of a second
            generation round (the module's step must do it: `ExGRPOModule` does). `mix_fraction` caps how
            many questions each places.
        fill_from: when the buffer fills: "start" (from the first step) or "replay_start" (the official
            ExGRPO code: only steps that begin in the replay phase are stored, so the first replay step finds
            an empty buffer and stays fresh; before, nothing is stored and only groups solved by all K
            rollouts reach the bucketer, which retires their questions).
    """

    def __init__(
        self,
        buffer: TrajectoryBuffer | None = None,
        replay: SelectiveReplay | None = None,
        mode: str = "swap",
        mix_fraction: float = 0.5,
        replay_start_epoch: int | None = None,
        start_pass_rate: float | None = None,
        min_buffer_size: int = 1000,
        bounded_demand: bool = False,
        displaced_questions: str = "discard",
        max_consecutive_replay_steps: int = 4,
        placement: str = "displace",
        fill_from: str = "start",
    ) -> None:
        self.buffer = buffer if buffer is not None else TrajectoryBuffer()
        self.replay = replay if replay is not None else SelectiveReplay()
        self.mode = mode
        self.mix_fraction = mix_fraction
        self.replay_start_epoch = replay_start_epoch
        self.start_pass_rate = start_pass_rate
        self.min_buffer_size = min_buffer_size
        self.bounded_demand = bool(bounded_demand)
        self.displaced_questions = displaced_questions
        self.max_consecutive_replay_steps = max_consecutive_replay_steps
        self.consecutive_replay_steps = 0  # swap replay steps in a row up to the last step
        self.forced_fresh_steps = 0  # steps kept fresh by max_consecutive_replay_steps
        # (stored rows, B x K) while a swap step that hands training_step fewer than B x K rows runs
        self._short_swap_step: tuple[int, int] | None = None
        self._resumed_at: str | None = None  # resumable_fit_progress's answer for the checkpoint resumed from
        self.placement = placement
        self.fill_from = fill_from
        self._filling = True  # whether this step's rollouts are stored (fill_from)
        self.deferred_total = 0  # questions deferred in this run, resumes included
        self._warned_small_stream = False
        self.pass_rate_reached = False  # whether a step's fresh pass rate exceeded start_pass_rate
        self.fallback_steps = 0
        self.replayed_steps = 0
        self._fresh_rows_seen, self._nonzero_reward_seen = 0, False  # this process's run: see note_rewards
        # Seconds of this step's replay bookkeeping (buffer add, sampling, rescoring); logged on logging
        # steps, readable on every step (benchmarks/overhead.py sums them).
        self.last_timings: dict[str, float] = {}
        self._rank_writes_own_file = False  # DeepSpeed ZeRO-3: see state_dict()
        self._retire_at_epoch_start = True  # setup() decides
        self._contract = StepChecker(mode)  # what the datamodule and training_step hand over, with the fix
        replay_checks.check_options(self)  # again in setup(): an option can be set after construction

    # ------------------------------------------------------------------------------ decisions
    @property
    def hparams(self) -> dict[str, Any]:
        """The options of the callback, its buffer, bucketer and sampler, flat (`replay_checks.options`); the
        module shows them beside its own in TensorBoard's HParams tab."""
        return replay_checks.options(self)

    @property
    def defers(self) -> bool:
        """Whether displaced fresh questions come back (`displaced_questions="defer"`), read when used, so an
        option set after construction counts."""
        return self.displaced_questions == "defer"

    def replay_active(self, trainer: Trainer) -> bool:
        """Whether the replay phase has begun (every configured trigger holds)."""
        epoch_ok = self.replay_start_epoch is None or trainer.current_epoch >= self.replay_start_epoch
        return epoch_ok and (self.start_pass_rate is None or self.pass_rate_reached)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(pl_module, ReplayableModule):
            raise TypeError(
                f"ReplayCallback needs a module following exgrpo_pl.contract.ReplayableModule "
                f"(num_generations, score_entropy and entropy_forwards); {type(pl_module).__name__} does not"
            )
        replay_checks.check_options(self)
        replay_checks.check_trainer(self, trainer)
        self._contract.mode = self.mode
        self._rank_writes_own_file = zero_stage(trainer) == 3
        self.replay.follow_run_seed()
        # Retire right before each pass is drawn where the datamodule says when that is (PromptDataModule):
        # a run resumed from an epoch's end draws its next pass before any epoch hook, and Lightning may
        # skip that epoch's on_train_epoch_start.
        add_pass_hook = getattr(trainer.datamodule, "add_pass_hook", None)
        self._retire_at_epoch_start = add_pass_hook is None
        if add_pass_hook is not None:
            add_pass_hook(self._exclude_retired)
        if self.defers and stage == "fit":
            replay_checks.check_streams(trainer.datamodule)
            trainer.datamodule.stream_passes()

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        replay_checks.check_module(self, pl_module)  # after configure_model, which may build the policy
        placement.check_module(self, pl_module)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._resumed_at == "epoch end":
            settle_resumed_step_count(trainer)
        replay_checks.warn_if_unreachable(self, trainer, pl_module.num_generations)
        module_checks.warn_if_loader_cannot_resume(trainer, pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        module_checks.warn_if_rewards_all_zero(self)
        replay_checks.warn_if_never_replayed(self, trainer)

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._retire_at_epoch_start:
            self._exclude_retired(trainer.datamodule)

    def _exclude_retired(self, datamodule) -> None:
        """Sets the questions the next pass leaves out: the bucketer's `out_of_stream` in the epoch about to
        run (retired questions, where `retire_from` says they leave the stream and re-admission has not
        brought them back), on every rank alike."""
        exclude = getattr(datamodule, "exclude_questions", None) if datamodule else None
        epoch = datamodule.trainer.current_epoch if datamodule and datamodule.trainer else 0
        out = union_across_ranks(self.buffer.bucketer.out_of_stream(epoch))
        if exclude is not None:
            exclude(out)
            self._warn_small_stream(len(out), len(getattr(datamodule, "train_rows", ())))
        elif out:
            rank_zero_warn(
                "ReplayCallback: the datamodule has no exclude_questions(); retired questions stay in"
            )

    def _warn_small_stream(self, out: int, pool: int) -> None:
        """Once, when retired questions are more than half of the training pool."""
        if self._warned_small_stream or not pool or 2 * out <= pool:
            return
        self._warned_small_stream = True
        rank_zero_warn(
            f"ReplayCallback: {out} of the {pool} training questions are retired (a whole group solved "
            f"them) and left the fresh stream; {pool - out} are left, the hardest ones. Over many epochs of "
            "a small set this narrows training to them. DifficultyBucketer(retire_from='buffer') keeps "
            "solved questions in the stream, readmit_after_epochs=N brings them back after N epochs."
        )

    @override
    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._contract.check_batch(batch)
        replay_checks.check_mix_batch(self, len(batch["prompt"]))
        self.buffer.bucketer.epoch = trainer.current_epoch
        self.last_timings = {"timing/replay_sample": 0.0, "timing/replay_rescore": 0.0}
        self._short_swap_step = None
        self._filling = self.fill_from == "start" or self.replay_active(trainer)
        # Any step that returns before the end below generates: the run of swap replay steps ends there.
        in_a_row, self.consecutive_replay_steps = self.consecutive_replay_steps, 0
        if not self.replay_active(trainer) or not self.replay.should_replay():
            return
        if self.mode == "swap" and in_a_row >= self.max_consecutive_replay_steps:
            self.forced_fresh_steps += 1
            return
        size = self._demand(batch, pl_module.num_generations)
        if self.defers and self.mode == "mix":  # as many displaced on every rank: their streams stay alike
            size = min_across_ranks(trainer, size)
        if not all_ranks(trainer, len(self.buffer) >= self.min_buffer_size and size > 0):
            self.fallback_steps += 1
            return
        started = time.perf_counter()
        synced = self.replay.rescores and needs_synced_generation(trainer)
        rescoring = Rescoring(trainer, pl_module, synced, self.replay.trajectory_selection)
        # Only join draws among given questions: a SelectiveReplay subclass predating `questions` still runs.
        among = {"questions": placement.joinable(self, batch)} if self.placement == "join" else {}
        experience = self.replay.sample(self.buffer, size, entropy_fn=rescoring, **among)
        # Before any other collective (the all-reduce below is one), so every rank's sequence matches.
        rescoring.join(experience)
        self.last_timings["timing/replay_rescore"] = rescoring.seconds
        self.last_timings["timing/replay_sample"] = time.perf_counter() - started - rescoring.seconds
        if self.defers and self.mode == "mix":  # a rank may draw fewer than `size`
            experience = experience.select(torch.arange(min_across_ranks(trainer, len(experience))))
        if not all_ranks(trainer, len(experience) > 0):
            self.fallback_steps += 1
            return
        if self.placement == "join":  # last: a mixed step replaces them by their own stored rows
            placement.put_last(batch, experience.question_ids)
        batch["experience"] = Experience(self.mode, experience, self.placement)
        self.replayed_steps += 1
        if self.mode == "swap":
            self.consecutive_replay_steps = in_a_row + 1
            full = len(batch["prompt"]) * pl_module.num_generations
            self._short_swap_step = (len(experience), full) if len(experience) < full else None
        if self.defers:
            self._defer_displaced(trainer, batch, len(experience))

    def _defer_displaced(self, trainer: Trainer, batch: Any, replayed: int) -> None:
        """Hands the questions this step displaces back to the datamodule's stream: a mixed step's last
        `replayed` (as `plan_rollouts` leaves them out), a swap step's whole batch."""
        questions = len(batch["prompt"])
        displaced = questions if self.mode == "swap" else min(replayed, questions)
        ids = batch["question_id"][questions - displaced :]
        trainer.datamodule.defer_questions([int(qid) for qid in ids])
        self.deferred_total += displaced

    def _demand(self, batch: dict, k: int) -> int:
        return placement.demand(self, batch, k)  # a method: a test's subclass makes ranks' demands differ

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._short_swap_step = None
        checked = len(self._contract.checked)
        rollouts = self._contract.check_outputs(outputs, batch, pl_module.num_generations)
        if len(self._contract.checked) > checked:  # the first step of its kind: its fields were checked
            eos = module_checks.eos_token_ids(pl_module)
            module_checks.check_completion_mask(rollouts, eos)
            module_checks.check_eos_trained(rollouts, eos)
        self._contract.check_module(pl_module, outputs, batch)
        module_checks.note_rewards(self, rollouts)
        fresh = ~rollouts.replayed
        if self.start_pass_rate is not None and not self.pass_rate_reached and bool(fresh.any()):
            pass_rate = rollouts.correct[fresh].float().mean()
            pass_rate = trainer.strategy.reduce(pass_rate, reduce_op="mean")
            self.pass_rate_reached = float(pass_rate) > self.start_pass_rate
        started = time.perf_counter()
        if not outputs.get("skipped", False):  # a skipped update's rows were never fully scored
            placement.count_gave_way(self.buffer, outputs.get("gave_way"))
            if self._filling:
                self.buffer.add(rollouts.to("cpu"))
            else:
                fill.retire_solved(self.buffer, rollouts.to("cpu"))
        self.last_timings["timing/replay_add"] = time.perf_counter() - started
        self._log(trainer, pl_module, rollouts)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._short_swap_step is not None:  # the step that failed was a swap step with fewer rows
            replay_checks.note_short_swap_step(exception, *self._short_swap_step)

    def _log(self, trainer: Trainer, pl_module: LightningModule, rollouts) -> None:
        if not writes_step_metrics(trainer):  # only when a logger will see it: tier counts scan the buffer
            return
        metrics = replay_metrics(self, trainer, rollouts)  # over all ranks
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(rollouts))

    # ---------------------------------------------------------------------------- checkpoints
    @override
    def state_dict(self) -> dict[str, Any]:
        """Tensors and primitives only (loads with `torch.load(weights_only=True)`); every rank keeps its own
        buffer, laid out for whoever writes the checkpoint file (`replay_state.for_checkpoint`)."""
        own = {
            "buffer": self.buffer.state_dict(),
            "replay": self.replay.state_dict(),
            "pass_rate_reached": self.pass_rate_reached,
            "fallback_steps": self.fallback_steps,
            "replayed_steps": self.replayed_steps,
            "deferred_total": self.deferred_total,
            "consecutive_replay_steps": self.consecutive_replay_steps,
            "forced_fresh_steps": self.forced_fresh_steps,
            "options": replay_checks.options(self),
            # A module of one's own may sample from the global generators: a resume continues them.
            "global_rng": global_rng_state(),
        }
        return replay_state.for_checkpoint(own, self._rank_writes_own_file)

    @override
    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        replay_checks.warn_if_saved_without(self, checkpoint)
        # Lightning resumes a checkpoint saved after a batch's end (max_steps, an epoch's end) one batch off;
        # ExGRPOModule rewrites its progress itself (before this hook: then this finds nothing to rewrite),
        # a module of one's own does not, and its replay would go on from another step than the saved one.
        self._resumed_at = resumable_fit_progress(checkpoint)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores this rank's own state, from either layout that `state_dict()` writes
        (`replay_state.own_state`)."""
        own = replay_state.own_state(state_dict)
        current, default = replay_checks.options(self), replay_checks.defaults(self)
        replay_checks.warn_changed(own.get("options"), current, default)
        self.buffer.load_state_dict(own["buffer"])
        self.replay.load_state_dict(own["replay"])
        self.pass_rate_reached = own["pass_rate_reached"]
        self.fallback_steps = own["fallback_steps"]
        self.replayed_steps = own["replayed_steps"]
        self.deferred_total = own.get("deferred_total", 0)  # saved since displaced_questions exists
        # Saved since max_consecutive_replay_steps exists; before, no run of swap steps was counted.
        self.consecutive_replay_steps = own.get("consecutive_replay_steps", 0)
        self.forced_fresh_steps = own.get("forced_fresh_steps", 0)
        if "global_rng" in own:  # saved since the callback restores them
            restore_global_rng_state(own["global_rng"])

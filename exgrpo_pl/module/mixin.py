"""ReplayMixin: what `ReplayCallback` needs from a GRPO LightningModule, derived from the module's policy.

    class MyGRPO(ReplayMixin, LightningModule): ...

The callback rescores stored trajectories with the current policy (the paper's trajectory selection) through
`score_entropy`, and under ZeRO-3/FSDP asks `entropy_forwards` how many policy forwards that takes, so that
every rank runs the same number. The mixin implements both with `exgrpo_pl.step.rollout.score_entropy` on the
module's transformers policy; override `replay_policy` if yours is not `self.policy` or `self.model`.

Three more methods make a GRPO `training_step` honour `batch["experience"]` in a few lines
(examples/own_module.py, docs/replay_contract.md): `replay_groups` (what to train on, sampled with your
own sampler, with the advantages you say: your own definition or the library's; refilled too under
`placement="refill"`), `record_behaviour` (the fresh rows' behaviour log-probs and entropy from your first
forward) and `replay_loss` (the replayed rows' importance-weighted
policy-gradient terms; add your KL and entropy terms after it). `fresh_rows` and `replayed_rows` split a
step's rollouts for your own reward and accuracy logs, and `fresh_groups` gives per-group metrics the
groups of fresh rows, by `rollouts.group_size`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial, wraps

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import CONTRACT_DOC, ContractError
from exgrpo_pl.lightning_internals import attached_trainer, batches_that_stepped
from exgrpo_pl.step.groups import record_behaviour, replayed_token_loss, sample_groups
from exgrpo_pl.step.logprobs import DEFAULT_CHUNK_ELEMENTS
from exgrpo_pl.step.losses import SCALE_REWARDS
from exgrpo_pl.step.official_pick import official_pick_scores
from exgrpo_pl.step.refill import AdvantageFn, advantages_of, dead_places, refill_plan, refilled
from exgrpo_pl.step.rollout import num_micro_batches, score_entropy
from exgrpo_pl.step.sampling import sample_plan
from exgrpo_pl.step.update import sum_over_ranks


class ReplayMixin:
    """`score_entropy` and `entropy_forwards` of `exgrpo_pl.contract.ReplayableModule`, from the policy.

    Reads the module's sampling temperature (`sampling_temperature`: `self.temperature`, else
    `hparams.temperature`; without either, `ReplayCallback` stops before the first step naming the member to
    add), and, when the module has them, `hparams.micro_batch_size` (rows per training forward, hence per
    rescoring forward),
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

    def sampling_temperature(self) -> float:
        """The temperature the module samples at: `self.temperature`, else `hparams.temperature`.

        Rescoring stored trajectories (entropy) must use the sampler's own temperature, so there is no
        default: a module with neither gets a `ContractError` naming the member to add (`ReplayCallback`
        asks when fitting starts, before the first step). Override this if the temperature lives elsewhere.
        """
        value = getattr(self, "temperature", None)
        value = self._replay_setting("temperature", None) if value is None else value
        if value is None:
            raise ContractError(
                f"{type(self).__name__} has neither `temperature` nor `hparams.temperature`: set "
                "`self.temperature = <the temperature your sampler uses>` in __init__ (or override "
                "ReplayMixin.sampling_temperature()); replay rescores stored trajectories' entropy at it, "
                f"see {CONTRACT_DOC}"
            )
        return float(value)

    def _replay_setting(self, name: str, default):
        value = getattr(getattr(self, "hparams", None), name, None)
        return default if value is None else value

    def score_entropy(self, rollouts: RolloutBatch, num_forwards: int | None = None) -> Tensor:
        """`[N]` mean completion-token entropy under the current policy (the paper's trajectory selection).

        `num_forwards`: run exactly that many forwards (see `exgrpo_pl.contract.ReplayableModule`).
        """
        return score_entropy(self.replay_policy(), rollouts.to(self.device), **self._rescoring(num_forwards))

    def score_official_entropy(self, rollouts: RolloutBatch, num_forwards: int | None = None) -> Tensor:
        """`[N]` the official code's trajectory score of `rollouts`, in order, under the current policy
        (`trajectory_selection="official_inverted_mask_entropy"`, see `exgrpo_pl.step.official_pick`), over
        the last `max_completion_length` positions, with `score_entropy`'s forwards."""
        window = self._replay_setting("max_completion_length", rollouts.completion_ids.shape[1])
        return official_pick_scores(
            self.replay_policy(), rollouts.to(self.device), window, **self._rescoring(num_forwards)
        )

    def _rescoring(self, num_forwards: int | None) -> dict:
        tokenizer = getattr(self, "tokenizer", None)
        return {
            "temperature": self.sampling_temperature(),
            "micro_batch_size": self.rescore_rows(),
            "num_forwards": num_forwards,
            "pad_token_id": getattr(tokenizer, "pad_token_id", None) or 0,
            "chunk_elements": self._replay_setting("logit_chunk_elements", DEFAULT_CHUNK_ELEMENTS),
        }

    def entropy_forwards(self, rollouts: RolloutBatch) -> int:
        """Policy forwards that `score_entropy(rollouts)` runs: one per micro-batch."""
        return num_micro_batches(len(rollouts), self.rescore_rows())

    def rescore_rows(self) -> int:
        """Rows per rescoring forward: the training `micro_batch_size`, else K (`num_generations`)."""
        return self._replay_setting("micro_batch_size", self.num_generations)

    # ------------------------------------------------------------- a replay-ready training_step
    replay_gave_way: RolloutBatch | None = None  # the latest refill step's groups that gave way

    def replay_groups(
        self,
        batch: dict,
        rollout_fn: Callable[..., Sequence],
        advantages: AdvantageFn | str | None = None,
    ) -> RolloutBatch:
        """The rows this step trains on, `batch["experience"]` honoured, with advantages, on `self.device`.

        `exgrpo_pl.step.groups.sample_groups` with K = `num_generations`, `global_step` as the policy version,
        and `hparams.correct_threshold` (0.5) when the module has it. The groups of K (fresh, mixed and
        refilled ones) get the advantages `advantages` says; a swap step's stored rows keep the buffer's
        `reward - current rate`, scaled as `hparams.scale_rewards` ("group") says. Under data parallelism
        "batch" scaling divides by the std of every rank's rewards (an all-reduce).

        With `ReplayCallback(placement="refill")` (the module declares `replay_placements = ("displace",
        "join", "refill")`) it refills too: the places of groups whose K rewards are all equal go to the
        first stored rows of `batch["experience"]` (as many on every rank), each with K-1 rollouts of a
        second `rollout_fn` call (`exgrpo_pl.step.refill`); the groups that gave way are then
        `self.replay_gave_way` (None on other steps), which the step returns under `"gave_way"`.

        A sampler that returns each reward function's rewards by name (`{"accuracy": [N], ...}` in place of
        `rewards`) gets their sum as the row's reward, and each function's mean over the rows it sampled
        (fresh rows only; none on a swap step) logged as `rewards/<name>`.

        Args:
            batch: the training batch.
            rollout_fn: `rollout_fn(prompts, **columns) -> (prompt_ids, prompt_mask, completion_ids,
                completion_mask, rewards[, completions])`, one scored completion per prompt entry.
            advantages: the module's own advantage definition, `[G, K]` group rewards -> `[G, K]`
                (`advantages=self._compute_advantages`); or "group", "batch" or "none" for the library's
                `group_advantages` (eps 1e-4) under that scaling; None: the module's `compute_advantages`,
                and a `ContractError` naming both ways when it has none (no default replaces a module's
                own advantages unasked).
        """
        own, scale = self._advantage_choice(advantages)
        parts: list[Mapping] = []
        rollout_fn = _recording_reward_parts(rollout_fn, parts)
        settings = {
            "policy_version": self.global_step,
            "correct_threshold": self._replay_setting("correct_threshold", 0.5),
        }
        ranks = partial(sum_over_ranks, attached_trainer(self))  # "batch": every rank's std
        rollouts = sample_groups(
            batch, self.num_generations, rollout_fn, scale_rewards=scale, sum_over_ranks=ranks, **settings
        ).to(self.device)
        experience, self.replay_gave_way = batch.get("experience"), None
        k = rollouts.group_size
        if k == self.num_generations and len(rollouts):  # groups of K: not a swap step's stored rows
            if experience is not None and experience.placement == "refill":
                rollouts, self.replay_gave_way = self._refill(
                    rollouts, experience.rollouts, rollout_fn, settings, scale, own
                )
            elif own is not None:
                rollouts.advantages = advantages_of(rollouts.rewards, k, scale, advantages=own)
        self._unweighted_replayed_rows = 0 if experience is None else int(rollouts.replayed.sum())
        self._log_reward_parts(parts)
        return rollouts

    def _advantage_choice(self, advantages: AdvantageFn | str | None) -> tuple[AdvantageFn | None, str]:
        """(the module's advantage definition, or None for `group_advantages`; the reward scaling)."""
        scale = self._replay_setting("scale_rewards", "group")
        if callable(advantages):
            return advantages, scale
        if advantages in SCALE_REWARDS:
            return None, advantages
        name = type(self).__name__
        if advantages is not None:
            raise ValueError(
                f"{name}.replay_groups advantages={advantages!r}: give a function of [G, K] group rewards "
                f"returning [G, K] advantages, or one of {', '.join(SCALE_REWARDS)}"
            )
        own = getattr(self, "compute_advantages", None)
        if callable(own):
            return own, scale
        candidates = [a for a in dir(type(self)) if "advantage" in a.lower() and not hasattr(ReplayMixin, a)]
        found = (
            f" {name} has {', '.join(candidates)}: if that is its definition, pass it." if candidates else ""
        )
        example = candidates[0] if candidates else "my_advantages"
        raise ContractError(
            f"{name}.replay_groups(batch, rollout_fn) was not told how to compute advantages, and {name} has "
            f"no compute_advantages.{found} Pass the module's own, replay_groups(batch, self.rollout, "
            f"advantages=self.{example}) ([G, K] group rewards -> [G, K] advantages, applied to every group "
            "of K, refilled ones included), or advantages='group' for the library's group_advantages (eps "
            f"1e-4; 'batch' and 'none' scale otherwise); see {CONTRACT_DOC}"
        )

    def _refill(
        self, rollouts, pool, rollout_fn, settings, scale, own
    ) -> tuple[RolloutBatch, RolloutBatch | None]:
        """(rows to train on, groups that gave way): dead groups' places filled from the pool's first rows,
        as many on every rank (a second generation round is collective under ZeRO-3)."""
        places = dead_places(rollouts)
        n = min(int(places.sum()), len(pool))
        trainer = attached_trainer(self)
        if trainer is not None and trainer.world_size > 1:
            n = int(trainer.strategy.reduce(torch.tensor(n, device=self.device), reduce_op="min"))
        k, ranks = rollouts.group_size, partial(sum_over_ranks, trainer)
        if n == 0:
            rollouts.advantages = advantages_of(rollouts.rewards, k, scale, ranks, own)
            return rollouts, None
        plan = refill_plan(pool, n, k)
        fresh = sample_plan(plan, rollout_fn, **settings).to(self.device)
        return refilled(rollouts, places, plan, fresh, scale, ranks, own)

    def _log_reward_parts(self, parts: list[Mapping]) -> None:
        """Each reward function's mean over the rows the sampler scored in this step, as `rewards/<name>`."""
        if not parts or attached_trainer(self) is None:
            return
        for name in parts[0]:
            values = [
                torch.as_tensor(part[name], device=self.device).float() for part in parts if name in part
            ]
            rows = sum(len(v) for v in values)
            self.log(
                f"rewards/{name}", torch.cat(values).mean(), on_step=True, on_epoch=False, batch_size=rows
            )

    def fresh_rows(self, rollouts: RolloutBatch) -> RolloutBatch:
        """The rows this policy sampled in this step (`replayed` False): what your own reward and accuracy
        logs should read, so that stored (correct) rows do not inflate them."""
        return rollouts.select(~rollouts.replayed, group_size=1)

    def replayed_rows(self, rollouts: RolloutBatch) -> RolloutBatch:
        """The stored rows this step replayed (`replayed` True)."""
        return rollouts.select(rollouts.replayed, group_size=1)

    def fresh_groups(self, rollouts: RolloutBatch, values: Tensor | None = None) -> Tensor:
        """`[G, k]` per-row `values` (default: the rewards) of the step's groups whose rows are all fresh, k
        being `rollouts.group_size`: what per-group metrics (a group's spread, the share of groups whose
        rewards are all equal) should read. A mixed group (its stored row first) is left out, and a swap
        step, whose stored rows come in groups of 1, has none (`[0, 1]`); reshaping by the configured K
        instead would read the stored correct rows as groups."""
        k = rollouts.group_size
        values = rollouts.rewards if values is None else values
        fresh = ~rollouts.replayed.view(-1, k).any(1)  # [G]
        return values.reshape(-1, k)[fresh]

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

        Pass the policy-gradient term only and add the module's other terms (a KL penalty to a reference, an
        entropy bonus) after it, `self.replay_loss(pg, logps, rollouts) + beta * kl`: they then apply to
        replayed rows as to fresh ones. `logps` must carry gradients (the replayed rows' only gradient flows
        through them): a `ContractError` says so when they do not.

        See `exgrpo_pl.step.groups.replayed_token_loss`; reads `hparams.off_policy_correction` ("shaping"),
        `hparams.shaping_beta` (0.1) and `hparams.is_truncation` (2.0) when the module has them. With
        replayed rows it logs `train/is_weight`, their mean f(w), as `ExGRPOModule` does. `rows`: the rows of
        `rollouts` that `per_token` and `logps` are of, for a micro-batch (default: all).
        """
        self._unweighted_replayed_rows = 0
        replayed = rollouts.replayed[rows]
        if torch.is_grad_enabled() and not logps.requires_grad and bool(replayed.any()):
            raise ContractError(
                f"{type(self).__name__}.replay_loss got log-probs without gradient for {int(replayed.sum())} "
                "replayed rows, which would train on nothing: pass the log-probs of the training forward "
                "itself, not a .detach()ed copy or one computed under torch.no_grad() (the ratio's "
                f"`logps - logps.detach()` keeps them); see {CONTRACT_DOC}"
            )
        stats: dict[str, Tensor] = {}
        per_token = replayed_token_loss(
            per_token, logps, rollouts, self._replay_setting("off_policy_correction", "shaping"),
            self._replay_setting("shaping_beta", 0.1), self._replay_setting("is_truncation", 2.0), stats,
            rows,
        )  # fmt: skip
        if stats and attached_trainer(self) is not None:
            is_weight = self._step_mean_is_weight(stats["is_weight"])
            self.log("train/is_weight", is_weight, on_step=True, on_epoch=False, batch_size=len(per_token))
        return per_token

    def _step_mean_is_weight(self, value: Tensor) -> Tensor:
        """The mean `is_weight` of this step's `replay_loss` calls with replayed rows so far, this one's
        `value` included: Lightning writes the last value a step logged, so a step that calls `replay_loss`
        once per micro-batch logs the mean over them, as `ExGRPOModule` does."""
        step = batches_that_stepped(self.trainer)
        total, calls, at = getattr(self, "_is_weight_calls", (0.0, 0, None))
        if at != step:
            total, calls = 0.0, 0
        self._is_weight_calls = (total + value.detach(), calls + 1, step)
        return self._is_weight_calls[0] / self._is_weight_calls[1]


def _recording_reward_parts(
    rollout_fn: Callable[..., Sequence], parts: list[Mapping]
) -> Callable[..., Sequence]:
    """`rollout_fn`, keeping each call's per-function rewards (a mapping in place of `rewards`) in `parts`."""

    @wraps(rollout_fn)
    def scored(prompts, **columns):
        sampled = rollout_fn(prompts, **columns)
        if isinstance(sampled, (tuple, list)) and len(sampled) > 4 and isinstance(sampled[4], Mapping):
            parts.append(sampled[4])
        return sampled

    return scored

"""Which rollouts a training step generates, and how they and replayed experience become GRPO groups.

The bookkeeping a GRPO step needs to honour `batch["experience"]` (see `exgrpo_pl.contract`), as two pure
functions, so any GRPO module (ours, or your own) trains replay the same way:

    plan = plan_rollouts(batch, num_generations)     # what to sample: plan.prompts x plan.repeats
    fresh = ...                                      # sample and score them: a RolloutBatch, one row each
    rollouts = assemble_groups(plan, fresh, "group") # the groups to train on, with advantages

or, with a sampler of your own (`rollout_fn(prompts, **columns)` returning the prompt/completion ids and masks
and the rewards), the three at once: `rollouts = sample_groups(batch, num_generations, rollout_fn)`. The
step's first forward then gives the fresh rows their behaviour log-probs and entropy (`record_behaviour`),
and `replayed_token_loss` puts the replayed rows' importance-weighted term into the per-token loss.

- No experience: every question of the batch gets K fresh rollouts.
- Mix (the paper): the batch's last `len(experience)` questions give way to the replayed questions. Each
  replayed question gets K-1 fresh rollouts, and its group is its stored trajectory followed by them;
  advantages are computed over all K.
- Swap (the seed): nothing is generated; the step trains on the replayed rows alone, with their stored
  baseline advantage put on the scale of on-policy ones (`replay_advantages`).

Plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import Experience, check_answers
from exgrpo_pl.losses import (
    SCALE_REWARDS,
    compute_importance_weights,
    group_advantages,
    masked_mean,
    token_entropy,
)

# Batch keys the plan consumes itself; every other list-valued key is a dataset column for the rewards.
RESERVED_KEYS = ("prompt", "question_id", "experience")


@dataclass
class RolloutPlan:
    """What one training step samples, and the stored rows it trains on besides.

    Args:
        prompts: prompt strings to sample from: the batch's fresh questions, then the replayed ones.
        question_ids: `[len(prompts)]` long.
        repeats: rollouts to sample per prompt: K for a fresh question, K-1 for a replayed one.
        columns: dataset columns per prompt (reward-function keyword arguments). Replayed questions carry
            only their `answer` (and `domain` when the batch has one); their other columns are None.
        experience: the replayed rows (`replayed` True), or None.
        mode: "fresh" (no experience), "mix" or "swap".
        group_size: K.
    """

    prompts: list[str]
    question_ids: Tensor
    repeats: list[int]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    experience: RolloutBatch | None = None
    mode: str = "fresh"
    group_size: int = 1

    @property
    def num_rollouts(self) -> int:
        """Completions to sample in all: one row of the fresh `RolloutBatch` each."""
        return sum(self.repeats)

    def expand(self, values: list[Any]) -> list[Any]:
        """Per-prompt values repeated into per-rollout rows (the order `assemble_groups` expects)."""
        if len(values) != len(self.prompts):
            raise ValueError(f"expand got {len(values)} values for {len(self.prompts)} prompts")
        return [v for v, r in zip(values, self.repeats) for _ in range(r)]


def dataset_columns(batch: dict) -> dict[str, list[Any]]:
    """The dataset columns of a batch that reward functions receive as keyword arguments."""
    return {
        key: list(value)
        for key, value in batch.items()
        if key not in RESERVED_KEYS and isinstance(value, (list, tuple))
    }


def plan_rollouts(batch: dict, num_generations: int) -> RolloutPlan:
    """What a step with this batch samples (see the module docstring for the three cases).

    Args:
        batch: a training batch: `prompt` (list of str), `question_id` (`[B]` long), optional dataset columns
            (lists), optional `experience` (an `Experience`, put there by `ReplayCallback`).
        num_generations: K, rollouts per question.
    """
    for key in ("prompt", "question_id"):
        if key not in batch:
            raise ValueError(
                f"training batch has no {key!r} key (it has {sorted(batch)}): batches must be dicts with "
                "'prompt' (list of str) and 'question_id' ([B] long tensor), as exgrpo_pl.data.collate_rows "
                "makes them"
            )
    k = num_generations
    experience: Experience | None = batch.get("experience")
    question_ids = torch.as_tensor(batch["question_id"], dtype=torch.long)
    columns = dataset_columns(batch)
    if experience is None:
        n = len(batch["prompt"])
        return RolloutPlan(list(batch["prompt"]), question_ids, [k] * n, columns, group_size=k)
    stored = experience.rollouts
    if experience.mode == "swap":
        return RolloutPlan([], question_ids[:0], [], {}, stored, "swap", group_size=k)
    check_answers(batch)  # the fresh questions' answers are stored, to score a later replay's rollouts
    n_fresh = max(len(batch["prompt"]) - len(stored), 0)
    columns = {key: values[:n_fresh] + [None] * len(stored) for key, values in columns.items()}
    columns["answer"] = columns["answer"][:n_fresh] + list(stored.answers)
    if stored.domains is not None and "domain" in columns:
        columns["domain"][n_fresh:] = stored.domains
    return RolloutPlan(
        prompts=list(batch["prompt"][:n_fresh]) + list(stored.prompts),
        question_ids=torch.cat([question_ids[:n_fresh], stored.question_ids.cpu()]),
        repeats=[k] * n_fresh + [k - 1] * len(stored),
        columns=columns,
        experience=stored,
        mode="mix",
        group_size=k,
    )


def assemble_groups(plan: RolloutPlan, fresh: RolloutBatch | None, scale_rewards: str) -> RolloutBatch:
    """The rows to train on, grouped by question, with advantages.

    Args:
        plan: the step's `plan_rollouts`.
        fresh: the sampled and scored rollouts of `plan`: `plan.num_rollouts` rows in `plan.expand` order
            (each prompt's rollouts next to each other, prompts in plan order). None in swap mode.
        scale_rewards: "group", "batch" or "none", as for `group_advantages`.

    Returns:
        A `RolloutBatch` with `group_size` K (1 in swap mode) and `advantages` set. In mix mode each replayed
        question's group is its stored row followed by its K-1 fresh rows, after the fresh questions' groups.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}; allowed: {', '.join(SCALE_REWARDS)}")
    k = plan.group_size
    if plan.mode == "swap":
        rows = plan.experience
        if fresh is not None and len(fresh):
            raise ValueError("a swap-mode step samples nothing: pass fresh=None")
        return replace(rows, advantages=replay_advantages(rows.rewards, rows.advantages, k, scale_rewards))
    _check_fresh(plan, fresh)
    if plan.mode == "fresh":
        rollouts = fresh.select(torch.arange(len(fresh)), group_size=k)
    else:
        stored = plan.experience.to(fresh.question_ids.device)
        n_fresh = len(plan.prompts) - len(stored)
        order = list(range(n_fresh * k))
        for j in range(len(stored)):
            order.append(len(fresh) + j)
            start = n_fresh * k + j * (k - 1)
            order.extend(range(start, start + k - 1))
        rollouts = RolloutBatch.cat([fresh, stored], group_size=1).select(order, group_size=k)
    rollouts.advantages = group_advantages(rollouts.rewards, k, scale_rewards)
    return rollouts


def replay_advantages(rewards: Tensor, baselines: Tensor, num_generations: int, scale_rewards: str) -> Tensor:
    """Swap-mode advantages on the scale of on-policy ones. `[N]`, `[N]` -> `[N]`.

    A swap-mode row's stored advantage is `r - p`, its reward minus its question's current correctness rate
    (a fresh baseline: the buffer computes it when it samples the row). On-policy advantages under "group"
    scaling are divided by the std of the question's K rewards; for 0/1 rewards at rate p that std is
    sqrt(p (1 - p) K / (K - 1)) (unbiased, as `group_advantages` computes it), so the replayed advantage
    is divided by the same number, computed from p; "batch" divides by the std of the batch's rewards, as
    on-policy rows are; "none" keeps `r - p`. Without this a replayed step under "group" scaling would be
    about half the size of an on-policy one.

    Args:
        rewards: `[N]` the rows' rewards.
        baselines: `[N]` the stored advantages `r - p`.
        num_generations: K of the on-policy groups whose scale to match.
        scale_rewards: "group", "batch" or "none".
    """
    if scale_rewards == "none":
        return baselines
    if scale_rewards == "batch":
        return baselines / (rewards.std() + 1e-4)
    rate = (rewards - baselines).clamp(0.0, 1.0)  # [N] p, recovered from r - p
    k = num_generations
    std = (rate * (1 - rate) * k / (k - 1)).sqrt()  # [N]
    return baselines / (std + 1e-4)


def _check_fresh(plan: RolloutPlan, fresh: RolloutBatch | None) -> None:
    """Say what is wrong when `fresh` does not hold the plan's rollouts in the plan's order."""
    if fresh is None:
        raise ValueError(f"a {plan.mode!r} step needs its {plan.num_rollouts} sampled rollouts, got None")
    if len(fresh) != plan.num_rollouts:
        raise ValueError(
            f"the plan samples {plan.num_rollouts} rollouts (repeats {plan.repeats}), the fresh RolloutBatch "
            f"has {len(fresh)} rows: sample plan.prompts[i] exactly plan.repeats[i] times"
        )
    expected = plan.question_ids.repeat_interleave(torch.tensor(plan.repeats, dtype=torch.long))
    if not torch.equal(fresh.question_ids.cpu(), expected):
        raise ValueError(
            "the fresh RolloutBatch's question_ids are not in plan order: rows must be "
            "plan.expand(plan.question_ids.tolist()), each prompt's rollouts next to each other"
        )
    if bool(fresh.replayed.any()):
        raise ValueError("fresh rollouts must have replayed=False; the stored rows come from plan.experience")


# What a `sample_groups` sampler returns, in this order (optionally followed by the decoded completions).
SAMPLED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rewards")


def fresh_rollouts(
    plan: RolloutPlan,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    rewards: Tensor | Sequence[float],
    completions: Sequence[str] | None = None,
    *,
    policy_version: int = 0,
    correct_threshold: float = 0.5,
) -> RolloutBatch:
    """The fresh `RolloutBatch` of `plan`, from the tensors a module sampled and scored.

    Row i is a completion of `plan.expand(plan.prompts)[i]`. Masks may be 0/1 integers (a tokenizer's
    `attention_mask`): they are made bool. `behaviour_logps` and `entropy` stay 0 until the step's first
    forward fills them (`record_behaviour`), `advantages` until `assemble_groups`.

    Args:
        plan: the step's `plan_rollouts`.
        prompt_ids: `[N, P]` left-padded prompt tokens, N = `plan.num_rollouts`.
        prompt_mask: `[N, P]` True (or 1) on real prompt tokens.
        completion_ids: `[N, C]` right-padded completion tokens.
        completion_mask: `[N, C]` True (or 1) on real completion tokens, up to and including EOS.
        rewards: `[N]` rewards.
        completions: N decoded completions; optional (DifficultyMonitor's table shows them).
        policy_version: the step whose policy sampled them (`self.global_step`).
        correct_threshold: a row is correct when its reward exceeds this.
    """
    n = plan.num_rollouts
    device = completion_ids.device
    rewards = torch.as_tensor(rewards, device=device).float()
    for name, value, shape in (
        ("prompt_ids", prompt_ids, None),
        ("prompt_mask", prompt_mask, prompt_ids.shape),
        ("completion_ids", completion_ids, None),
        ("completion_mask", completion_mask, completion_ids.shape),
        ("rewards", rewards, None),
    ):
        ndim = 1 if name == "rewards" else 2
        if value.ndim != ndim or value.shape[0] != n or (shape is not None and value.shape != shape):
            want = f"[{n}]" if name == "rewards" else f"[{n}, width]" + (" like its ids" if shape else "")
            raise ValueError(
                f"{name} has shape {list(value.shape)}; the plan samples {n} rollouts "
                f"(plan.expand(plan.prompts), repeats {plan.repeats}), so it must be {want}"
            )
    columns = {key: plan.expand(values) for key, values in plan.columns.items()}
    repeats = torch.tensor(plan.repeats, dtype=torch.long)
    zeros = torch.zeros(n, device=device)
    return RolloutBatch(
        question_ids=plan.question_ids.repeat_interleave(repeats).to(device),
        prompt_ids=prompt_ids.long(),
        prompt_mask=prompt_mask.bool(),
        completion_ids=completion_ids.long(),
        completion_mask=completion_mask.bool(),
        behaviour_logps=torch.zeros(completion_ids.shape, device=device),  # the first forward's, later
        rewards=rewards,
        correct=rewards > correct_threshold,
        entropy=zeros.clone(),
        advantages=zeros,
        policy_version=torch.full((n,), policy_version, dtype=torch.long, device=device),
        replayed=torch.zeros(n, dtype=torch.bool, device=device),
        group_size=1,
        prompts=plan.expand(plan.prompts),
        completions=[] if completions is None else list(completions),
        answers=[str(a) for a in columns.get("answer", [""] * n)],
        domains=columns.get("domain"),
    )


def sample_groups(
    batch: dict,
    num_generations: int,
    rollout_fn: Callable[..., Sequence],
    *,
    scale_rewards: str = "group",
    policy_version: int = 0,
    correct_threshold: float = 0.5,
) -> RolloutBatch:
    """`plan_rollouts`, your sampler, `fresh_rollouts` and `assemble_groups`: the groups a step trains on.

    Args:
        batch: the training batch, `batch["experience"]` included when `ReplayCallback` put one there.
        num_generations: K.
        rollout_fn: `rollout_fn(prompts, **columns)` samples one completion per entry of `prompts` (each
            question already repeated as often as it needs) and scores it; `columns` are the batch's dataset
            columns (`answer`, ...) per row, as reward functions receive them. It returns `(prompt_ids,
            prompt_mask, completion_ids, completion_mask, rewards)`, optionally followed by the decoded
            completions (see `fresh_rollouts`). A swap step samples nothing and does not call it.
        scale_rewards: "group", "batch" or "none", as for `group_advantages`.
        policy_version: the step whose policy samples (`self.global_step`).
        correct_threshold: a row is correct when its reward exceeds this.

    Returns:
        As `assemble_groups`: groups of K rows (stored row first in a replayed question's group) with their
        advantages; a swap step's stored rows, one per group. Replayed rows arrive on the CPU and stay
        there in a swap step: move the result with `.to(device)`.
    """
    plan = plan_rollouts(batch, num_generations)
    fresh = None
    if plan.num_rollouts:
        columns = {key: plan.expand(values) for key, values in plan.columns.items()}
        sampled = rollout_fn(plan.expand(plan.prompts), **columns)
        if not isinstance(sampled, (tuple, list)) or len(sampled) not in (len(SAMPLED), len(SAMPLED) + 1):
            got = f"{len(sampled)} values" if isinstance(sampled, (tuple, list)) else type(sampled).__name__
            raise TypeError(
                f"rollout_fn returned {got}; it must return ({', '.join(SAMPLED)}), optionally followed by "
                "the decoded completions"
            )
        _check_sampled_rows(plan, sampled, rollout_fn)
        fresh = fresh_rollouts(
            plan, *sampled, policy_version=policy_version, correct_threshold=correct_threshold
        )
    return assemble_groups(plan, fresh, scale_rewards)


def _check_sampled_rows(plan: RolloutPlan, sampled: Sequence, rollout_fn: Callable) -> None:
    """Say, in the sampler's terms, which value did not come back with one row per prompt it was given."""
    n, k = plan.num_rollouts, plan.group_size
    fn = getattr(rollout_fn, "__qualname__", None) or type(rollout_fn).__name__
    repeats = f"K = {k} times" + (f", K-1 = {k - 1} for a replayed question" if plan.mode == "mix" else "")
    for name, value in zip((*SAMPLED, "completions"), sampled):
        try:
            rows = len(value)
        except TypeError:  # not a sequence: fresh_rollouts says what it must be
            continue
        if rows == n:
            continue
        given = f"rollout_fn ({fn}) was given {n} prompts, each question already repeated ({repeats})"
        if rows > n and rows % n == 0:
            raise ValueError(
                f"{given}, and returned {rows} rows of {name}, {rows // n} per prompt: it must sample ONE "
                f"completion per entry of `prompts`, since sample_groups does the repeating; drop "
                f"num_return_sequences (or the repeat) from {fn}"
            )
        raise ValueError(
            f"{given}, and returned {rows} rows of {name}: it must return one row per entry of `prompts`, "
            "in their order"
        )


@torch.no_grad()
def record_behaviour(rollouts: RolloutBatch, logps: Tensor, logits: Tensor) -> None:
    """Give the fresh rows the behaviour log-probs and entropy of the step's first forward (in place).

    Call it with the forward taken before any update on this batch: its log-probs are those of the policy
    that sampled the rows, which the importance weights of a later replay divide by, and its entropy is
    what the buffer ranks trajectories by. Replayed rows keep what they carry.

    Args:
        rollouts: the step's rows (`sample_groups` / `assemble_groups`).
        logps: `[N, C]` log-probs of the completion tokens from that forward.
        logits: `[N, C, V]` the logits that predicted them, divided by the sampling temperature as the
            sampler did; or `[N, C]` token entropies.
    """
    mask = rollouts.completion_mask
    if logps.shape != mask.shape or logits.shape[:2] != mask.shape:
        raise ValueError(
            f"record_behaviour: logps {list(logps.shape)} and logits {list(logits.shape)} must be [N, C] and "
            f"[N, C, V] with [N, C] = completion_ids' {list(mask.shape)}"
        )
    fresh = ~rollouts.replayed
    if not bool(fresh.any()):
        return
    scored = logps.detach().float().masked_fill(~mask, 0.0)  # [N, C]
    rollouts.behaviour_logps = torch.where(fresh.unsqueeze(1), scored, rollouts.behaviour_logps)
    entropy = token_entropy(logits.detach()) if logits.ndim == 3 else logits.detach().float()  # [N, C]
    rollouts.entropy = torch.where(fresh, masked_mean(entropy, mask, dim=1), rollouts.entropy)


def replayed_token_loss(
    per_token: Tensor,
    logps: Tensor,
    rollouts: RolloutBatch,
    correction: str = "shaping",
    shaping_beta: float = 0.1,
    truncation: float = 2.0,
    stats: dict[str, Tensor] | None = None,
) -> Tensor:
    """`per_token` `[N, C]` with each replayed row's terms replaced by ExGRPO's -f(w) A.

    A replayed row was sampled by an older policy, so the clipped ratio against this step's own log-probs
    says nothing about it; ExGRPO weights its tokens by f(w), w = pi_theta / pi_behaviour from the stored
    behaviour log-probs, unclipped, as `compute_grpo_loss` does (`compute_importance_weights`: policy
    shaping w / (w + beta) by default). Fresh rows keep their terms; without replayed rows `per_token` is
    returned as it is.

    Args:
        per_token: `[N, C]` the module's per-token loss (e.g. the clipped surrogate).
        logps: `[N, C]` current log-probs of the completion tokens, with grad.
        rollouts: the step's rows: `replayed`, `behaviour_logps`, `advantages`, `completion_mask`.
        correction: as for `compute_importance_weights`.
        shaping_beta: as for `compute_importance_weights`.
        truncation: as for `compute_importance_weights`.
        stats: when given and there are replayed rows, receives `is_weight`, the mean f(w) over their
            completion tokens (detached; `ExGRPOModule` logs the same as `train/is_weight`).
    """
    replayed = rollouts.replayed.unsqueeze(1)  # [N, 1]
    if not bool(replayed.any()):
        return per_token
    weights = compute_importance_weights(
        logps, rollouts.behaviour_logps, rollouts.completion_mask, correction, shaping_beta, truncation
    )  # [N, C]
    if stats is not None:
        stats["is_weight"] = masked_mean(weights.detach(), rollouts.completion_mask & replayed)
    return torch.where(replayed, -weights * rollouts.advantages.unsqueeze(1).to(weights.dtype), per_token)

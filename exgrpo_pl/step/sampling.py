"""A step's groups from a sampler of your own: `sample_groups` plans the rollouts, calls
`rollout_fn(prompts, **columns)` once (`sample_plan`), turns what it returns into the fresh `RolloutBatch`
(`fresh_rollouts`) and assembles the groups, saying in the sampler's terms what came back wrong. A sampler
may return each reward function's rewards by name (`{"accuracy": [N], "format": [N]}`): a row's reward is
their sum (`total_reward`).

Part of `exgrpo_pl.step.groups` (see there for the whole step); plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.step.assembly import assemble_groups
from exgrpo_pl.step.losses import SumOverRanks
from exgrpo_pl.step.plan import RolloutPlan, plan_rollouts

# What a `sample_groups` sampler returns, in this order (optionally followed by the decoded completions).
SAMPLED = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "rewards")
# Errors a reward function or a reshape raises when a sampler's rows outnumber its prompts.
_ROW_COUNT_ERRORS = (ValueError, IndexError, RuntimeError)


def total_reward(rewards: Tensor | Sequence[float] | Mapping[str, Tensor | Sequence[float]]) -> Tensor:
    """`[N]` float rewards: `rewards` itself, or, given each reward function's `[N]` rewards by name (weighted
    as the module wants them added), their sum, added in the mapping's order."""
    if not isinstance(rewards, Mapping):
        return torch.as_tensor(rewards).float()
    if not rewards:
        raise ValueError("rewards is an empty mapping: give each reward function's [N] rewards by name")
    parts = [torch.as_tensor(values).float() for values in rewards.values()]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def fresh_rollouts(
    plan: RolloutPlan,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    rewards: Tensor | Sequence[float] | Mapping[str, Tensor | Sequence[float]],
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
        rewards: `[N]` rewards, or each reward function's `[N]` rewards by name (`total_reward` adds them).
        completions: N decoded completions; optional (DifficultyMonitor's table shows them).
        policy_version: the step whose policy sampled them (`self.global_step`).
        correct_threshold: a row is correct when its reward exceeds this.
    """
    n = plan.num_rollouts
    device = completion_ids.device
    rewards = total_reward(rewards).to(device)
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
        columns=columns,
    )


def sample_groups(
    batch: dict,
    num_generations: int,
    rollout_fn: Callable[..., Sequence],
    *,
    scale_rewards: str = "group",
    policy_version: int = 0,
    correct_threshold: float = 0.5,
    sum_over_ranks: SumOverRanks | None = None,
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
        sum_over_ranks: as for `assemble_groups` (under DDP, e.g. `lambda t: self.trainer.strategy.reduce(t,
            reduce_op="sum")`, so that "batch" scaling takes the std of every rank's rewards).

    Returns:
        As `assemble_groups`: groups of K rows (stored row first in a replayed question's group) with their
            advantages; a swap step's stored rows, one per group. Replayed rows arrive on the CPU and stay
            there in a swap step: move the result with `.to(device)`.
    """
    plan = plan_rollouts(batch, num_generations)
    fresh = None
    if plan.num_rollouts:
        settings = {"policy_version": policy_version, "correct_threshold": correct_threshold}
        fresh = sample_plan(plan, rollout_fn, **settings)
    return assemble_groups(plan, fresh, scale_rewards, sum_over_ranks)


def sample_plan(
    plan: RolloutPlan,
    rollout_fn: Callable[..., Sequence],
    *,
    policy_version: int = 0,
    correct_threshold: float = 0.5,
) -> RolloutBatch:
    """The fresh `RolloutBatch` of `plan` (`plan.num_rollouts` > 0) from one call of your sampler:
    `rollout_fn(plan.expand(plan.prompts), **columns)`, checked to return one row per prompt it was given.

    Args:
        plan: a `plan_rollouts` (or `exgrpo_pl.step.refill.refill_plan`) with rollouts to sample.
        rollout_fn: as for `sample_groups`.
        policy_version: the step whose policy samples (`self.global_step`).
        correct_threshold: a row is correct when its reward exceeds this.
    """
    columns = {key: plan.expand(values) for key, values in plan.columns.items()}
    try:
        sampled = rollout_fn(plan.expand(plan.prompts), **columns)
    except _ROW_COUNT_ERRORS as error:  # e.g. a reward function's zip over more completions than prompts
        error.add_note(_one_per_prompt_note(plan, rollout_fn))
        raise
    if not isinstance(sampled, (tuple, list)) or len(sampled) not in (len(SAMPLED), len(SAMPLED) + 1):
        got = f"{len(sampled)} values" if isinstance(sampled, (tuple, list)) else type(sampled).__name__
        raise TypeError(
            f"rollout_fn returned {got}; it must return ({', '.join(SAMPLED)}), optionally followed by "
            "the decoded completions"
        )
    _check_sampled_rows(plan, sampled, rollout_fn)
    return fresh_rollouts(plan, *sampled, policy_version=policy_version, correct_threshold=correct_threshold)


def _given(plan: RolloutPlan, rollout_fn: Callable) -> tuple[str, str]:
    """(the sampler's name, what it was given), for messages."""
    n, k = plan.num_rollouts, plan.group_size
    fn = getattr(rollout_fn, "__qualname__", None) or type(rollout_fn).__name__
    repeats = f"K = {k} times" + (f", K-1 = {k - 1} for a replayed question" if plan.mode == "mix" else "")
    return fn, f"rollout_fn ({fn}) was given {n} prompts, each question already repeated ({repeats})"


def _one_per_prompt_note(plan: RolloutPlan, rollout_fn: Callable) -> str:
    """What to check when the sampler itself raised: a sampler that still draws K completions per prompt
    fails in its own reward functions (more completions than prompts and columns), before returning."""
    fn, given = _given(plan, rollout_fn)
    return (
        f"sample_groups: this error came from inside the sampler. {given}, and every column it gets has "
        f"{plan.num_rollouts} entries. If it samples more than one completion per prompt "
        f"(num_return_sequences={plan.group_size}, or a repeat of its own), its completions outnumber its "
        f"prompts and columns, and reward functions and reshapes fail like this: sample ONE completion per "
        f"entry of `prompts` in {fn}."
    )


def _check_sampled_rows(plan: RolloutPlan, sampled: Sequence, rollout_fn: Callable) -> None:
    """Say, in the sampler's terms, which value did not come back with one row per prompt it was given."""
    n = plan.num_rollouts
    fn, given = _given(plan, rollout_fn)
    named = list(zip((*SAMPLED, "completions"), sampled))
    if isinstance(sampled[4], Mapping):  # each reward function's rewards: one row per prompt each
        named[4:5] = [(f"rewards[{key!r}]", value) for key, value in sampled[4].items()]
    for name, value in named:
        try:
            rows = len(value)
        except TypeError:  # not a sequence: fresh_rollouts says what it must be
            continue
        if rows == n:
            continue
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

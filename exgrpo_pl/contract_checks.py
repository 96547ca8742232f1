"""The checks that enforce the replay contract (`exgrpo_pl.contract`), no Lightning: each `check_*` says
what is wrong and what to return instead, with a `ContractError`; `ReplayCallback` runs them through a
`StepChecker`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import BATCH_KEYS, CONTRACT_DOC, RETURN_FIX, ContractError, Experience


def check_batch(batch: Any, mode: str | None = None) -> None:
    """Raise a `ContractError` naming the missing or malformed key, and the batch contract.

    The callbacks read training batches that are dicts with `prompt` (a list of prompts) and `question_id`
    (`[B]` integers: a long tensor, or a list of ints, which `plan_rollouts` accepts too). With
    `mode="mix"` the batch must also have `answer` (`check_answers`), from the first step on, before any
    replay.
    """
    keys = ", ".join(f"{key!r} ({what})" for key, what in BATCH_KEYS.items())
    contract = (
        f"ReplayCallback needs training batches that are dicts with {keys}, as "
        f"exgrpo_pl.data.PromptDataModule (collate_rows) makes them; see {CONTRACT_DOC}"
    )
    if not isinstance(batch, Mapping):
        raise ContractError(f"the training batch is a {type(batch).__name__}: {contract}")
    for key in BATCH_KEYS:
        if key not in batch:
            raise ContractError(
                f"the training batch has no {key!r} key (it has {sorted(map(str, batch))}): rename the "
                f"datamodule's key. {contract}"
            )
    prompts, ids = batch["prompt"], batch["question_id"]
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (str, list)) for p in prompts):
        raise ContractError(
            f"batch['prompt'] is not a list of prompts, each a str or a list of chat messages"
            f" ({type(prompts).__name__}): {contract}"
        )
    if isinstance(ids, Tensor):
        bad = ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.shape != (len(prompts),)
    else:
        bad = not isinstance(ids, (list, tuple)) or len(ids) != len(prompts)
        bad = bad or not all(isinstance(i, int) for i in ids)
    if bad:
        got = f"{ids.dtype} of shape {list(ids.shape)}" if isinstance(ids, Tensor) else type(ids).__name__
        raise ContractError(
            f"batch['question_id'] is {got} for {len(prompts)} prompts; it must be one integer id per prompt "
            f"(a [B] long tensor). {contract}"
        )
    if mode == "mix":
        check_answers(batch)


def check_answers(batch: Mapping) -> None:
    """Raise a `ContractError` unless `batch["answer"]` is a list with one answer per prompt.

    A mixed replay step samples new rollouts of a stored question and scores them with the dataset columns
    stored with it: all of them when the step's rollouts carry them (`RolloutBatch.columns`), else only
    the answer, which then comes from `batch["answer"]` alone. Without that key the replayed questions'
    rollouts may reach the reward functions with no answer to score against.
    """
    prompts, answers = batch["prompt"], batch.get("answer")
    if isinstance(answers, (list, tuple)) and len(answers) == len(prompts):
        return
    if answers is None:
        got = f"the training batch has no 'answer' key (it has {sorted(map(str, batch))})"
        fix = "rename the datamodule's key to 'answer' (PromptDataModule(answer_column=...) reads any column)"
    elif isinstance(answers, (list, tuple)):
        got = f"batch['answer'] has {len(answers)} entries for {len(prompts)} prompts"
        fix = "give one answer per prompt"
    else:
        got = f"batch['answer'] is a {type(answers).__name__}"
        fix = "collate the answers as a list (reward functions receive list-valued keys only)"
    raise ContractError(
        f"{got}: mix mode (ReplayCallback(mode='mix')) needs a list of one answer per prompt under 'answer'; "
        f"{fix}. A mixed replay step scores new rollouts of a stored question with the dataset columns "
        "stored with it: every column when the step's rollouts carry them (RolloutBatch.columns), else only "
        "the answer, kept from batch['answer']. A reward that needs no answer can have batch['answer'] = "
        f"[''] * B. See {CONTRACT_DOC}"
    )


def check_step_output(outputs: Any) -> RolloutBatch:
    """The `RolloutBatch` in what `training_step` returned, as Lightning hands it to callbacks.

    Lightning turns a returned tensor into `{"loss": tensor}` and None into `{}`; either lacks the rollouts
    the callback stores, and the `ContractError` says what to return instead.
    """
    if not isinstance(outputs, Mapping) or not outputs:
        got = "nothing" if isinstance(outputs, Mapping) else f"a {type(outputs).__name__}"
        raise ContractError(f"training_step returned {got}; ReplayCallback needs you to {RETURN_FIX}")
    missing = [key for key in ("loss", "rollouts") if key not in outputs]
    if missing:
        got = "only the loss" if set(outputs) == {"loss"} else f"a dict with keys {sorted(map(str, outputs))}"
        raise ContractError(
            f"training_step returned {got}, without {' and '.join(map(repr, missing))}; ReplayCallback needs "
            f"you to {RETURN_FIX}"
        )
    rollouts = outputs["rollouts"]
    if not isinstance(rollouts, RolloutBatch):
        raise ContractError(
            f"training_step's 'rollouts' is a {type(rollouts).__name__}, not an "
            f"exgrpo_pl.batch.RolloutBatch; {RETURN_FIX}"
        )
    return rollouts


# Dtype families of the tensor fields: (test, what the message asks for).
_INTEGER = (lambda d: d == torch.long, "torch.long")
_FLOAT = (lambda d: d.is_floating_point, "a float dtype")
_DTYPES = {
    "question_ids": _INTEGER, "prompt_ids": _INTEGER, "completion_ids": _INTEGER, "policy_version": _INTEGER,
    "behaviour_logps": _FLOAT, "rewards": _FLOAT, "entropy": _FLOAT, "advantages": _FLOAT,
}  # fmt: skip
# Field -> the field whose shape it must have; None: one value per row.
_SHAPES = {
    "prompt_mask": "prompt_ids", "completion_mask": "completion_ids", "behaviour_logps": "completion_ids",
    "question_ids": None, "rewards": None, "correct": None, "entropy": None, "advantages": None,
    "policy_version": None, "replayed": None,
}  # fmt: skip


def check_rollouts(rollouts: RolloutBatch, num_generations: int, scored: bool = True) -> None:
    """Raise a `ContractError` naming the field unless `rollouts` is what the buffer can store and replay.

    Checks dtypes (ids long, log-probs and rewards float; masks and flags are bool by construction), shapes
    (`[N, P]`, `[N, C]`, `[N]`), prompts and answers for every row when there are fresh rows (a mixed replay
    step samples new rollouts of a stored prompt and scores them against its stored answer), groups of K
    rows of one question when there are fresh rows, and, when `scored`, that the fresh rows carry behaviour
    log-probs and entropy (all exactly 0 means the step never filled them).

    Args:
        rollouts: what `training_step` returned under "rollouts".
        num_generations: the module's K.
        scored: whether the step finished scoring its rows (False for a skipped update).
    """
    fix = f"see {CONTRACT_DOC}"
    for name, (ok, want) in _DTYPES.items():
        dtype = getattr(rollouts, name).dtype
        if not ok(dtype):
            raise ContractError(f"rollouts.{name} is {dtype}; it must be {want} ({fix})")
    n = len(rollouts)
    for name in ("prompt_ids", "completion_ids"):
        if getattr(rollouts, name).ndim != 2:
            raise ContractError(
                f"rollouts.{name} has shape {list(getattr(rollouts, name).shape)}; want [N, width]"
            )
    for name, like in _SHAPES.items():
        shape = getattr(rollouts, name).shape
        want = (n,) if like is None else getattr(rollouts, like).shape
        if shape != want:
            what = f"the shape of {like}" if like else "one value per row"
            raise ContractError(
                f"rollouts.{name} has shape {list(shape)}; it must be {list(want)} ({what}; {fix})"
            )
    fresh = ~rollouts.replayed
    if not bool(fresh.any()):
        return
    for name in ("prompts", "answers"):
        if len(getattr(rollouts, name)) != n:
            raise ContractError(
                f"rollouts.{name} has {len(getattr(rollouts, name))} entries for {n} rows: the buffer "
                "stores each fresh row's prompt and answer, and a mixed replay step samples new rollouts of "
                "the stored prompt against the stored answer; give one entry per row "
                "(exgrpo_pl.step.groups.fresh_rollouts does)"
            )
    k = num_generations
    if rollouts.group_size != k:
        raise ContractError(
            f"rollouts.group_size is {rollouts.group_size} in a step with fresh rows; it must be K = "
            f"num_generations = {k}: each question's K rows next to each other (assemble_groups does this)"
        )
    groups = rollouts.question_ids.view(-1, k)  # [N/K, K]
    if not bool((groups == groups[:, :1]).all()):
        raise ContractError(
            f"rollouts' groups of {k} rows mix questions (question_ids {groups.tolist()[:4]}...): rows of "
            "one question must be contiguous, a replayed question's stored row first (assemble_groups does "
            "this)"
        )
    # Entropy first: `[N]`, and nonzero after any real forward, so the `[N, C]` test rarely runs.
    if scored and not bool(rollouts.entropy[fresh].any()):
        real = rollouts.completion_mask & fresh.unsqueeze(1)  # [N, C]
        if bool(real.any()) and not bool((rollouts.behaviour_logps.ne(0) & real).any()):
            raise ContractError(
                "the fresh rows' behaviour_logps and entropy are all 0: fill them from the step's first "
                "forward, before the update (ReplayMixin.record_behaviour or "
                "exgrpo_pl.step.groups.record_behaviour); replay divides by these log-probs and selects "
                "trajectories by this entropy"
            )


def check_experience_used(experience: Experience, rollouts: RolloutBatch) -> None:
    """Raise a `ContractError` unless the step trained on the experience it was given, flagged as replayed.

    The replayed rows of `rollouts` must be `experience.rollouts`' rows (the same question ids, as a
    multiset), and a swap step has no fresh rows. When they are not, it tells apart experience that was
    ignored from stored rows that came back with `replayed=False` (same question and completion tokens):
    unflagged, the buffer would count them as fresh evidence of difficulty and store them again.
    """
    stored = experience.rollouts
    replayed = rollouts.replayed.cpu()
    if experience.placement == "refill":  # a pool: the module took its first rows, as many as it refilled
        stored = stored.select(torch.arange(min(int(replayed.sum()), len(stored))))
    question_ids = rollouts.question_ids.cpu()
    given = torch.sort(stored.question_ids.cpu()).values
    got = torch.sort(question_ids[replayed]).values
    generated = int((~replayed).sum())
    if torch.equal(given, got) and (experience.mode == "mix" or generated == 0):
        return
    unflagged = _unflagged_rows(stored, rollouts, replayed)
    where = f"batch['experience'] ({experience.mode} mode, {len(stored)} stored rows)"
    if unflagged:
        raise ContractError(
            f"rows {unflagged[:8]} of the step's rollouts are rows of {where}, the same question and "
            "completion tokens, but have replayed=False: keep their replayed=True flag (assemble_groups and "
            "sample_groups do); unflagged, the buffer takes them for fresh evidence and stores them again"
        )
    if not len(got):
        raise ContractError(
            f"training_step ignored {where}: its rollouts have no replayed row. Read batch['experience'] "
            "(ReplayMixin.replay_groups, exgrpo_pl.step.groups.sample_groups or plan_rollouts + "
            f"assemble_groups do) and train on its rows; see {CONTRACT_DOC}"
        )
    if experience.mode == "swap" and generated:
        raise ContractError(
            f"a swap step generated {generated} fresh rows: it must train on {where} alone, generating "
            "nothing (plan_rollouts / sample_groups / ReplayMixin.replay_groups sample nothing in swap mode)"
        )
    raise ContractError(
        f"the step's replayed rows (question ids {got.tolist()[:8]}) are not the rows of {where} (question "
        f"ids {given.tolist()[:8]}): return every given row, flagged replayed=True, and nothing else flagged"
    )


def _unflagged_rows(stored: RolloutBatch, rollouts: RolloutBatch, replayed: Tensor) -> list[int]:
    """The stored rows of `rollouts` that came back with replayed=False, one per stored row.

    A row is a stored one when its question id and completion tokens are; a fresh rollout that happens to
    sample a stored completion is the same, so each stored row claims one row: first the flagged rows, then
    unflagged ones, a group's first row before the others (`assemble_groups` puts the stored row there) and
    earlier rows before later ones.
    """

    def key(batch: RolloutBatch, row: int) -> tuple[int, tuple[int, ...]]:
        tokens = batch.completion_ids[row][batch.completion_mask[row]]
        return int(batch.question_ids[row]), tuple(tokens.tolist())

    unclaimed = Counter(key(stored, r) for r in range(len(stored)))
    questions = {q for q, _ in unclaimed}
    k = max(rollouts.group_size, 1)
    rows = [r for r, q in enumerate(rollouts.question_ids.tolist()) if q in questions]
    rows.sort(key=lambda r: (not bool(replayed[r]), r % k != 0, r))
    unflagged = []
    for r in rows:
        row_key = key(rollouts, r)
        if unclaimed[row_key] > 0:
            unclaimed[row_key] -= 1
            if not replayed[r]:
                unflagged.append(r)
    return sorted(unflagged)


def check_replay_loss(module: Any) -> None:
    """Raise a `ContractError` when the step's `ReplayMixin.replay_groups` returned replayed rows that no
    `replay_loss` call weighted (a module without `unweighted_replayed_rows` is not checked)."""
    pending = getattr(module, "unweighted_replayed_rows", None)
    rows = pending() if callable(pending) else 0
    if rows:
        raise ContractError(
            f"{type(module).__name__}.training_step trained on {rows} replayed rows from replay_groups "
            "without calling replay_loss, so they got the on-policy loss term, as if this policy had sampled "
            "them. Pass the per-token loss through it before reducing it: per_token = "
            "self.replay_loss(per_token, logps, rollouts) (ExGRPO's importance-weighted term for replayed "
            f"rows); see {CONTRACT_DOC}"
        )


class StepChecker:
    """The checks `ReplayCallback` runs: the cheap ones every step, the field checks once per kind of step.

    Every step: `check_batch` and `check_step_output` (dict look-ups and isinstance), and on a replay step
    `check_experience_used` (a sort of the replayed question ids) and, through `check_module`,
    `check_replay_loss` (a counter).
    `check_rollouts` runs on the first fully scored step of each kind ("fresh", "swap", "mix"): a module's
    code path for a kind does not change between steps, and its field checks synchronise with the device.
    """

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode  # the callback's replay mode: "mix" needs batch["answer"]
        self.checked: set[str] = set()

    def check_batch(self, batch: Any) -> None:
        check_batch(batch, self.mode)

    def check_outputs(self, outputs: Any, batch: Mapping, num_generations: int) -> RolloutBatch:
        """The step's `RolloutBatch`, after the checks; a `ContractError` names the first problem."""
        rollouts = check_step_output(outputs)
        experience = batch.get("experience")
        if experience is not None:  # first: a misused experience is the likelier cause of odd fields
            check_experience_used(experience, rollouts)
        kind = "fresh" if experience is None else experience.mode
        if kind not in self.checked and not outputs.get("skipped", False):
            check_rollouts(rollouts, num_generations)
            self.checked.add(kind)
        return rollouts

    def check_module(self, module: Any, outputs: Mapping, batch: Mapping) -> None:
        """After `check_outputs`: `check_replay_loss` on a replay step whose update was not skipped."""
        if batch.get("experience") is not None and not outputs.get("skipped", False):
            check_replay_loss(module)

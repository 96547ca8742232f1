"""The contract checks: each breach is a ContractError that names the field or key and the fix."""

import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import ContractError, Experience
from exgrpo_pl.contract_checks import (
    StepChecker,
    check_batch,
    check_experience_used,
    check_rollouts,
    check_step_output,
)
from exgrpo_pl.step.groups import assemble_groups, plan_rollouts

K = 3


def rows(question_ids, replayed=False, seed=0):
    """Scored rows with random two-token completions, as a step returns them."""
    g = torch.Generator().manual_seed(seed)
    n = len(question_ids)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    return RolloutBatch(
        question_ids=torch.tensor(question_ids, dtype=torch.long),
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        completion_ids=torch.randint(3, 1000, (n, 2), generator=g),
        completion_mask=torch.ones(n, 2, dtype=torch.bool),
        behaviour_logps=-torch.rand(n, 2, generator=g) - 0.1,
        rewards=rewards,
        correct=rewards > 0.5,
        entropy=torch.rand(n, generator=g) + 0.1,
        advantages=torch.zeros(n),
        policy_version=torch.zeros(n, dtype=torch.long),
        replayed=torch.full((n,), replayed),
        prompts=[f"p{q}" for q in question_ids],
        completions=[""] * n,
        answers=[f"a{q}" for q in question_ids],
    )


def batch(num_questions=4, experience=None):
    b = {
        "prompt": [f"p{q}" for q in range(num_questions)],
        "question_id": torch.arange(num_questions),
        "answer": [f"a{q}" for q in range(num_questions)],
    }
    if experience is not None:
        b["experience"] = experience
    return b


def step(b, seed=1):
    """What a module that follows the contract trains on for batch `b`: plan, sample, assemble."""
    plan = plan_rollouts(b, K)
    fresh = rows(plan.expand(plan.question_ids.tolist()), seed=seed) if plan.num_rollouts else None
    return assemble_groups(plan, fresh, "group")


# ------------------------------------------------------------------------------------ batches
@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"prompts": ["a"], "question_id": torch.tensor([1])},
            r"no 'prompt' key \(it has \['prompts', 'question_id'\]\)",
        ),
        ({"prompt": ["a"], "id": torch.tensor([1])}, r"no 'question_id' key.*rename the datamodule's key"),
        ([("a", 1)], r"the training batch is a list"),
        ({"prompt": "a b", "question_id": torch.tensor([1])}, r"batch\['prompt'\] is not a list of prompts"),
        ({"prompt": [3], "question_id": torch.tensor([1])}, r"batch\['prompt'\] is not a list of prompts"),
        (
            {"prompt": ["a"], "question_id": torch.tensor([1.0])},
            r"question_id'\] is torch.float32.*\[B\] long tensor",
        ),
        ({"prompt": ["a", "b"], "question_id": torch.tensor([1])}, r"of shape \[1\] for 2 prompts"),
        ({"prompt": ["a"], "question_id": ["x"]}, r"question_id'\] is list for 1 prompts"),
    ],
)
def test_a_malformed_batch_names_the_key_and_the_batch_contract(bad, message):
    with pytest.raises(ContractError, match=message) as error:
        check_batch(bad)
    assert "'prompt' (list of prompts, one per question: str, or a list of chat messages)" in str(error.value)


def test_chat_message_prompts_pass_the_batch_check():
    messages = [{"role": "user", "content": "1+1="}]
    check_batch({"prompt": [messages, "2+2="], "question_id": torch.tensor([1, 2])})


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda b: b.update(answers=b.pop("answer")),
            r"no 'answer' key \(it has \['answers', .*\]\).*rename the datamodule's key to 'answer'",
        ),
        (lambda b: b.update(answer=torch.arange(4)), r"batch\['answer'\] is a Tensor.*as a list"),
        (lambda b: b.update(answer=["a0"]), r"batch\['answer'\] has 1 entries for 4 prompts.*one answer per"),
    ],
)
def test_mix_mode_needs_the_answer_key_from_the_first_batch(change, message):
    b = batch()
    change(b)
    check_batch(b)  # no replay, or swap mode: no answer needed
    check_batch(b, "swap")
    with pytest.raises(ContractError, match=message) as error:
        check_batch(b, "mix")
    assert (
        "mix mode (ReplayCallback(mode='mix')) needs a list of one answer per prompt under 'answer'"
        in str(error.value)
    )
    stored = stored_rows([10])
    with pytest.raises(ContractError, match=message):  # plan_rollouts, for modules that call it themselves
        plan_rollouts({**b, "experience": Experience("mix", stored)}, K)
    plan_rollouts({**b, "experience": Experience("swap", stored)}, K)


def test_batches_as_the_datamodule_makes_them_pass():
    check_batch(batch())
    check_batch(batch(), "mix")
    check_batch({"prompt": ("a", "b"), "question_id": [3, 4]})  # plan_rollouts accepts a list of ints too


# --------------------------------------------------------------------------- what the step returns
FIX = r'return \{"loss": loss, "rollouts": rollouts\} from training_step'


@pytest.mark.parametrize(
    "outputs, message",
    [
        ({}, "training_step returned nothing"),  # Lightning's form of None
        (
            {"loss": torch.tensor(1.0)},
            "training_step returned only the loss, without 'rollouts'",
        ),  # of a tensor
        ({"rollouts": rows([0])}, r"a dict with keys \['rollouts'\], without 'loss'"),
        (
            {"loss": 1.0, "rollouts": {"prompt_ids": []}},
            "'rollouts' is a dict, not an exgrpo_pl.batch.RolloutBatch",
        ),
        (torch.tensor(1.0), "training_step returned a Tensor"),
    ],
)
def test_a_step_that_does_not_return_its_rollouts_is_told_what_to_return(outputs, message):
    with pytest.raises(ContractError, match=message) as error:
        check_step_output(outputs)
    assert "ReplayMixin.replay_groups or exgrpo_pl.step.groups.sample_groups" in str(error.value)


def test_the_returned_rollouts_come_back():
    out = rows([0, 0, 0])
    assert check_step_output({"loss": torch.tensor(0.0), "rollouts": out, "skipped": False}) is out


# ---------------------------------------------------------------------------------- the fields
def test_a_contract_following_step_passes_in_every_mode():
    stored = replace(rows([10, 11], replayed=True, seed=2), group_size=1)
    for b in (
        batch(),
        batch(experience=Experience("mix", stored)),
        batch(experience=Experience("swap", stored)),
    ):
        out = step(b)
        check_rollouts(out, K)
        if "experience" in b:
            check_experience_used(b["experience"], out)


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "question_ids",
            lambda r: r.question_ids.int(),
            "question_ids is torch.int32; it must be torch.long",
        ),
        (
            "completion_ids",
            lambda r: r.completion_ids.int(),
            "completion_ids is torch.int32; it must be torch.long",
        ),
        (
            "behaviour_logps",
            lambda r: r.behaviour_logps.long(),
            "behaviour_logps is torch.int64; it must be a float",
        ),
        ("rewards", lambda r: r.rewards.long(), "rewards is torch.int64; it must be a float dtype"),
        (
            "behaviour_logps",
            lambda r: r.behaviour_logps[:, :1],
            r"behaviour_logps has shape \[6, 1\]; it must be \[6, 2\]",
        ),
        ("prompt_ids", lambda r: r.prompt_ids[:, 0], r"prompt_ids has shape \[6\]; want \[N, width\]"),
        (
            "rewards",
            lambda r: r.rewards.unsqueeze(1),
            r"rewards has shape \[6, 1\]; it must be \[6\] \(one value per row",
        ),
        ("prompts", lambda r: [], r"prompts has 0 entries for 6 rows.*fresh_rollouts does"),
        ("answers", lambda r: [], r"answers has 0 entries for 6 rows"),
        (
            "group_size",
            lambda r: 1,
            r"group_size is 1 in a step with fresh rows; it must be K = num_generations = 3",
        ),
        ("question_ids", lambda r: torch.tensor([0, 0, 1, 1, 1, 1]), r"groups of 3 rows mix questions"),
    ],
)
def test_a_wrong_field_is_named_with_what_it_must_be(field, value, message):
    out = step(batch(num_questions=2))
    # Bypass the constructor's own checks, as a module mutating its batch in place would.
    setattr(out, field, value(out))
    with pytest.raises(ContractError, match=message):
        check_rollouts(out, K)


def test_fresh_rows_without_behaviour_logps_and_entropy_are_caught_unless_the_update_was_skipped():
    out = step(batch())
    out.behaviour_logps = torch.zeros_like(out.behaviour_logps)
    out.entropy = torch.zeros_like(out.entropy)
    with pytest.raises(ContractError, match=r"behaviour_logps and entropy are all 0.*record_behaviour"):
        check_rollouts(out, K)
    check_rollouts(out, K, scored=False)
    out.entropy[0] = 0.5  # a policy sure of every token, but a real forward: not an error
    check_rollouts(out, K)


# ---------------------------------------------------------------------------- the experience
def stored_rows(question_ids, seed=2):
    return replace(rows(question_ids, replayed=True, seed=seed), group_size=1)


def test_ignored_experience_is_named_in_both_modes():
    for mode in ("mix", "swap"):
        b = batch(experience=Experience(mode, stored_rows([10, 11])))
        plain = step(batch())  # the module trained on the batch's questions as if nothing were given
        with pytest.raises(
            ContractError, match=rf"ignored batch\['experience'\] \({mode} mode, 2 stored rows\)"
        ):
            check_experience_used(b["experience"], plain)


@pytest.mark.parametrize("mode", ["mix", "swap"])
def test_stored_rows_returned_unflagged_are_told_apart_from_ignored_experience(mode):
    experience = Experience(mode, stored_rows([10, 11]))
    out = step(batch(experience=experience))
    out.replayed = torch.zeros_like(out.replayed)
    unflagged = [6, 9] if mode == "mix" else [0, 1]  # the stored rows lead the last two groups in mix mode
    with pytest.raises(
        ContractError, match=re.escape(f"rows {unflagged} of the step's rollouts are rows of batch")
    ) as e:
        check_experience_used(experience, out)
    assert "keep their replayed=True flag" in str(e.value)


def test_fresh_rows_that_sampled_a_stored_completion_are_not_named_as_unflagged_stored_rows():
    experience = Experience("mix", stored_rows([10, 11]))
    out = step(batch(experience=experience))
    # Question 10's group is rows 6-8, its stored row first; row 8 is a fresh rollout that sampled the same
    # completion (a tiny vocabulary and short completions make that common).
    out.completion_ids[8] = out.completion_ids[6]
    check_experience_used(experience, out)  # flagged as it should be: no error
    out.replayed = torch.zeros_like(out.replayed)
    with pytest.raises(
        ContractError, match=re.escape("rows [6, 9] of the step's rollouts are rows of batch")
    ):
        check_experience_used(experience, out)
    out.replayed[6] = True  # one stored row kept its flag: only the other is named
    with pytest.raises(ContractError, match=re.escape("rows [9] of the step's rollouts are rows of batch")):
        check_experience_used(experience, out)


def test_a_swap_step_that_also_generated_and_wrongly_flagged_rows_are_named():
    experience = Experience("swap", stored_rows([10, 11]))
    swap = step(batch(experience=experience))
    with pytest.raises(ContractError, match="a swap step generated 3 fresh rows"):
        check_experience_used(experience, RolloutBatch.cat([swap, rows([0, 0, 0])], group_size=1))
    other = replace(swap, question_ids=torch.tensor([10, 12]))
    with pytest.raises(
        ContractError, match=r"question ids \[10, 12\]\) are not the rows.*\(question ids \[10, 11\]\)"
    ):
        check_experience_used(experience, other)


def test_a_placement_is_checked_and_a_refill_step_trains_on_the_pools_first_rows():
    with pytest.raises(ValueError, match="placement='join'; allowed: displace"):
        Experience("swap", stored_rows([10]), "join")
    with pytest.raises(ValueError, match="placement='append'; allowed: displace, join, refill"):
        Experience("mix", stored_rows([10]), "append")
    pool = Experience("mix", stored_rows([10, 11, 12]), "refill")
    check_experience_used(pool, step(batch()))  # no group gave its place: nothing of the pool trained on
    first = Experience("mix", stored_rows([10]))
    check_experience_used(pool, step(batch(experience=first)))  # its first row, in a mixed group
    second = Experience("mix", stored_rows([11]))
    with pytest.raises(ContractError, match=r"question ids \[11\]\) are not the rows"):
        check_experience_used(pool, step(batch(experience=second)))


@settings(max_examples=40)
@given(
    num_questions=st.integers(1, 5),
    stored_questions=st.lists(st.integers(100, 103), min_size=1, max_size=5),
    mode=st.sampled_from(["mix", "swap"]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_assembled_steps_pass_and_any_unflagged_stored_row_is_caught(
    num_questions, stored_questions, mode, seed, data
):
    stored = stored_rows(stored_questions[:num_questions] if mode == "mix" else stored_questions, seed=seed)
    experience = Experience(mode, stored)
    out = step(batch(num_questions, experience), seed=seed + 1)
    check_experience_used(experience, out)
    check_rollouts(out, K)
    row = data.draw(st.sampled_from(out.replayed.nonzero().flatten().tolist()))
    out.replayed = out.replayed.clone()
    out.replayed[row] = False
    with pytest.raises(ContractError, match=rf"rows \[{row}\] of the step's rollouts .* replayed=False"):
        check_experience_used(experience, out)


# -------------------------------------------------------------------------------- the checker
def test_the_checker_checks_fields_once_per_kind_and_experience_every_step():
    checker = StepChecker()
    experience = Experience("mix", stored_rows([10]))
    b = batch(experience=experience)
    good = step(b)
    checker.check_outputs({"loss": 0.0, "rollouts": good}, b, K)
    assert checker.checked == {"mix"}
    bad_fields = replace(good)
    bad_fields.rewards = good.rewards.long()
    checker.check_outputs({"loss": 0.0, "rollouts": bad_fields}, b, K)  # "mix" was checked: not again
    with pytest.raises(ContractError, match="rewards is torch.int64"):
        checker.check_outputs({"loss": 0.0, "rollouts": bad_fields}, batch(), K)  # the first fresh step
    ignored = step(batch())
    with pytest.raises(ContractError, match="ignored"):
        checker.check_outputs({"loss": 0.0, "rollouts": ignored}, b, K)  # experience: every replay step


def test_a_skipped_update_is_not_field_checked_and_does_not_count_as_checked():
    checker = StepChecker()
    out = step(batch())
    out.behaviour_logps = torch.zeros_like(out.behaviour_logps)
    out.entropy = torch.zeros_like(out.entropy)
    checker.check_outputs({"loss": float("nan"), "rollouts": out, "skipped": True}, batch(), K)
    assert checker.checked == set()

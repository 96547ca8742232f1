"""plan_rollouts / assemble_groups / replay_advantages: what a step samples and the groups it trains on."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import Experience
from exgrpo_pl.groups import assemble_groups, plan_rollouts, replay_advantages
from exgrpo_pl.losses import group_advantages


def rows(question_ids, rewards, replayed=False, prompts=None, answers=None, domains=None):
    """A RolloutBatch of one-token prompts and completions."""
    n = len(question_ids)
    rewards = torch.tensor(rewards, dtype=torch.float32)
    return RolloutBatch(
        question_ids=torch.tensor(question_ids),
        prompt_ids=torch.ones(n, 1, dtype=torch.long),
        prompt_mask=torch.ones(n, 1, dtype=torch.bool),
        completion_ids=torch.arange(n).unsqueeze(1),
        completion_mask=torch.ones(n, 1, dtype=torch.bool),
        behaviour_logps=torch.full((n, 1), -0.5),
        rewards=rewards,
        correct=rewards > 0.5,
        entropy=torch.zeros(n),
        advantages=torch.zeros(n),
        policy_version=torch.zeros(n, dtype=torch.long),
        replayed=torch.full((n,), replayed),
        prompts=prompts or [f"p{q}" for q in question_ids],
        completions=[str(i) for i in range(n)],
        answers=answers or [f"a{q}" for q in question_ids],
        domains=domains,
    )


def batch(experience=None):
    b = {
        "prompt": ["p0", "p1", "p2", "p3"],
        "question_id": torch.tensor([0, 1, 2, 3]),
        "answer": ["a0", "a1", "a2", "a3"],
        "domain": ["d0", "d1", "d2", "d3"],
        "source": ["s0", "s1", "s2", "s3"],
    }
    if experience is not None:
        b["experience"] = experience
    return b


def test_without_experience_every_question_gets_k_rollouts():
    plan = plan_rollouts(batch(), 3)
    assert (plan.mode, plan.prompts, plan.repeats) == ("fresh", ["p0", "p1", "p2", "p3"], [3, 3, 3, 3])
    assert plan.num_rollouts == 12 and plan.columns["source"] == ["s0", "s1", "s2", "s3"]
    assert plan.expand(["x", "y", "z", "w"])[:4] == ["x", "x", "x", "y"]
    fresh = rows(plan.expand(plan.question_ids.tolist()), [1, 0, 0] * 4)
    out = assemble_groups(plan, fresh, "none")
    assert out.group_size == 3
    assert torch.allclose(out.advantages, torch.tensor([2 / 3, -1 / 3, -1 / 3] * 4))


def test_mix_replaces_the_last_questions_and_puts_the_stored_row_first_in_its_group():
    stored = rows(
        [7, 9], [1, 1], replayed=True, prompts=["p7", "p9"], answers=["a7", "a9"], domains=["d7", "d9"]
    )
    plan = plan_rollouts(batch(Experience("mix", stored)), 3)
    assert plan.mode == "mix"
    assert plan.prompts == ["p0", "p1", "p7", "p9"] and plan.repeats == [3, 3, 2, 2]
    assert plan.question_ids.tolist() == [0, 1, 7, 9]
    assert plan.columns["answer"] == ["a0", "a1", "a7", "a9"]
    assert plan.columns["domain"] == ["d0", "d1", "d7", "d9"]
    assert plan.columns["source"] == ["s0", "s1", None, None]  # stored rows keep only answer and domain
    fresh = rows([0, 0, 0, 1, 1, 1, 7, 7, 9, 9], [1, 0, 0, 0, 0, 0, 0, 0, 1, 0])
    out = assemble_groups(plan, fresh, "none")
    assert out.question_ids.tolist() == [0, 0, 0, 1, 1, 1, 7, 7, 7, 9, 9, 9]
    assert out.replayed.tolist() == [False] * 6 + [True, False, False, True, False, False]
    assert out.completions == ["0", "1", "2", "3", "4", "5", "0", "6", "7", "1", "8", "9"]
    # Group of question 7: stored 1, fresh 0, 0 -> mean 1/3; of 9: 1, 1, 0 -> mean 2/3.
    expected = [2 / 3, -1 / 3, -1 / 3, 0, 0, 0, 2 / 3, -1 / 3, -1 / 3, 1 / 3, 1 / 3, -2 / 3]
    assert torch.allclose(out.advantages, torch.tensor(expected))


def test_swap_trains_on_the_stored_rows_alone():
    stored = rows([5, 6], [1.0, 0.0], replayed=True)
    stored.advantages = torch.tensor([0.5, -0.25])  # r - p with p = 0.5 and 0.25
    plan = plan_rollouts(batch(Experience("swap", stored)), 4)
    assert (plan.mode, plan.prompts, plan.num_rollouts) == ("swap", [], 0)
    out = assemble_groups(plan, None, "none")
    assert out.group_size == 1 and torch.equal(out.advantages, torch.tensor([0.5, -0.25]))
    assert torch.equal(stored.advantages, torch.tensor([0.5, -0.25]))  # the experience is not modified
    scaled = assemble_groups(plan, None, "group").advantages
    std = torch.tensor([0.25 * 4 / 3, 0.1875 * 4 / 3]).sqrt()
    assert torch.allclose(scaled, torch.tensor([0.5, -0.25]) / (std + 1e-4))


@given(st.lists(st.integers(0, 1), min_size=2, max_size=16))
def test_replayed_advantages_under_group_scaling_equal_those_of_a_group_at_the_same_rate(outcomes):
    """A row of a question at rate p gets the advantage its reward would get in a fresh group at rate p."""
    rewards = torch.tensor(outcomes, dtype=torch.float32)
    rate = rewards.mean()
    in_group = group_advantages(rewards, len(outcomes), "group")
    replayed = replay_advantages(rewards, rewards - rate, len(outcomes), "group")
    assert torch.allclose(replayed, in_group, atol=1e-4)


def test_replay_advantages_batch_and_none():
    rewards, baselines = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0.5, -0.5, 0.25])
    assert torch.equal(replay_advantages(rewards, baselines, 8, "none"), baselines)
    assert torch.allclose(
        replay_advantages(rewards, baselines, 8, "batch"), baselines / (rewards.std() + 1e-4)
    )


def test_fresh_rollouts_that_do_not_follow_the_plan_are_errors_that_say_what_to_sample():
    plan = plan_rollouts(batch(), 2)
    with pytest.raises(ValueError, match="the plan samples 8 rollouts .* has 6 rows"):
        assemble_groups(plan, rows([0, 0, 1, 1, 2, 2], [0] * 6), "group")
    with pytest.raises(ValueError, match="not in plan order"):
        assemble_groups(plan, rows([0, 1, 0, 1, 2, 2, 3, 3], [0] * 8), "group")
    with pytest.raises(ValueError, match="fresh rollouts must have replayed=False"):
        assemble_groups(plan, rows([0, 0, 1, 1, 2, 2, 3, 3], [0] * 8, replayed=True), "group")
    with pytest.raises(ValueError, match="needs its 8 sampled rollouts, got None"):
        assemble_groups(plan, None, "group")


def test_a_batch_without_the_needed_keys_names_them():
    with pytest.raises(ValueError, match="training batch has no 'prompt' key .*'prompts'"):
        plan_rollouts({"prompts": ["x"], "question_id": torch.tensor([0])}, 2)

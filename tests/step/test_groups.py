"""plan_rollouts / assemble_groups / replay_advantages, and the blocks a module of your own uses with them."""

import math
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.contract import Experience
from exgrpo_pl.experience import DifficultyBucketer, TrajectoryBuffer
from exgrpo_pl.step.groups import (
    assemble_groups,
    fresh_rollouts,
    plan_rollouts,
    record_behaviour,
    replay_advantages,
    replayed_token_loss,
    sample_groups,
    total_reward,
)
from exgrpo_pl.step.losses import (
    LossNormaliser,
    compute_grpo_loss,
    compute_importance_weights,
    group_advantages,
)


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


def test_mix_gives_each_replayed_question_the_columns_stored_with_it():
    columns = {
        "answer": [7, "a9"],  # as the dataset holds it: not made a string
        "domain": ["d7", None],
        "solution": ["s7", "s9"],
        "extra_info": [{"index": 7}, {"index": 9, "tags": ["x"]}],
    }
    stored = replace(rows([7, 9], [1, 1], replayed=True), columns=columns)
    plan = plan_rollouts(batch(Experience("mix", stored)), 3)
    # The union of keys: the batch's, then those only the stored questions have; None where one lacks a key.
    assert plan.columns == {
        "answer": ["a0", "a1", 7, "a9"],
        "domain": ["d0", "d1", "d7", None],
        "source": ["s0", "s1", None, None],
        "solution": [None, None, "s7", "s9"],
        "extra_info": [None, None, {"index": 7}, {"index": 9, "tags": ["x"]}],
    }
    assert list(plan.columns) == ["answer", "domain", "source", "solution", "extra_info"]


def test_a_question_replayed_from_the_buffer_is_scored_with_its_dataset_columns():
    """Fresh rows carry their batch's columns into the buffer; a later step replays two of the questions,
    and the sampler gets each one's own columns for its K-1 fresh rollouts."""
    first = {
        "prompt": ["p0", "p1", "p2"],
        "question_id": torch.tensor([0, 1, 2]),
        "answer": ["a0", "a1", "a2"],
        "solution": ["$0$", "$1$", "$2$"],
        "extra_info": [{"index": i, "split": "train"} for i in range(3)],
    }
    plan = plan_rollouts(first, 2)
    fresh = replace(
        rows(plan.expand(plan.question_ids.tolist()), [1, 0] * 3),
        columns={key: plan.expand(values) for key, values in plan.columns.items()},  # as collect makes them
    )
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(retire_from=None))
    buffer.add(assemble_groups(plan, fresh, "group"))
    stored = buffer.sample("uniform", size=2, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    later = {"prompt": ["p5", "p6"], "question_id": torch.tensor([5, 6]), "answer": ["a5", "a6"]}
    sample_groups({**later, "experience": Experience("mix", stored)}, 3, sampler)
    ((prompts, columns),) = sampler.calls
    for q in stored.question_ids.tolist():
        replayed = [i for i, prompt in enumerate(prompts) if prompt == f"p{q}"]
        assert len(replayed) == 2  # K - 1
        for key, values in first.items():
            if key not in ("prompt", "question_id"):
                assert [columns[key][i] for i in replayed] == [values[q]] * 2, key


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


# ------------------------------------------------------------------ building blocks for your own module
class Sampler:
    """A module's own sampler: one-token prompts, two-token completions, int masks as a tokenizer gives them,
    reward 1.0 for even rows; records what it was asked for."""

    def __init__(self, completions=False):
        self.calls = []
        self.completions = completions

    def __call__(self, prompts, **columns):
        self.calls.append((list(prompts), columns))
        n = len(prompts)
        out = (
            torch.full((n, 1), 4), torch.ones(n, 1, dtype=torch.long),
            torch.arange(2 * n).view(n, 2), torch.tensor([[1, 0]] * n), [float(i % 2 == 0) for i in range(n)],
        )  # fmt: skip
        return (*out, [f"c{i}" for i in range(n)]) if self.completions else out


def test_sample_groups_samples_what_the_plan_says_and_returns_the_groups():
    sampler = Sampler(completions=True)
    out = sample_groups(batch(), 3, sampler, policy_version=7)
    ((prompts, columns),) = sampler.calls
    assert prompts == ["p0"] * 3 + ["p1"] * 3 + ["p2"] * 3 + ["p3"] * 3
    assert columns["answer"][:4] == ["a0", "a0", "a0", "a1"] and set(columns) == {
        "answer",
        "domain",
        "source",
    }
    assert out.group_size == 3 and out.question_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert out.prompt_mask.dtype == out.completion_mask.dtype == torch.bool  # the sampler's int masks
    assert out.completion_mask[:, 1].sum() == 0 and out.completions[:2] == ["c0", "c1"]
    assert out.policy_version.tolist() == [7] * 12 and out.answers[3] == "a1" and out.domains[0] == "d0"
    assert torch.allclose(out.advantages, group_advantages(out.rewards, 3, "group"))
    assert out.correct.tolist() == [r > 0.5 for r in out.rewards.tolist()]


def test_sample_groups_in_mix_and_swap_mode():
    stored = rows([7, 9], [1, 0], replayed=True)
    sampler = Sampler()
    out = sample_groups(batch(Experience("mix", stored)), 3, sampler)
    ((prompts, columns),) = sampler.calls
    assert prompts == ["p0"] * 3 + ["p1"] * 3 + ["p7"] * 2 + ["p9"] * 2  # K-1 for a replayed question
    assert columns["answer"][-4:] == ["a7", "a7", "a9", "a9"]  # the stored answers
    assert out.replayed.tolist() == [False] * 6 + [True, False, False] * 2
    assert out.completions == [""] * 6 + ["0", "", "", "1", "", ""]  # the sampler gave none: "" for its rows
    swap = Sampler()
    out = sample_groups(batch(Experience("swap", stored)), 3, swap)
    assert swap.calls == [] and out.replayed.all() and out.group_size == 1


def test_a_sampler_that_returns_the_wrong_things_is_told_what_to_return():
    with pytest.raises(
        TypeError, match=r"rollout_fn returned 2 values; it must return \(prompt_ids, prompt_mask"
    ):
        sample_groups(batch(), 2, lambda prompts, **columns: (None, None))
    with pytest.raises(TypeError, match="rollout_fn returned dict"):
        sample_groups(batch(), 2, lambda prompts, **columns: {})
    plan = plan_rollouts(batch(), 2)
    ids, mask = torch.ones(8, 1, dtype=torch.long), torch.ones(8, 1, dtype=torch.bool)
    rewards = torch.zeros(8)
    with pytest.raises(
        ValueError, match=r"rollout_fn \(.*<lambda>\) was given 8 prompts.* 7 rows of rewards:"
    ):
        sample_groups(batch(), 2, lambda prompts, **columns: (ids, mask, ids, mask, rewards[:7]))
    with pytest.raises(
        ValueError, match=r"rewards has shape \[7\]; the plan samples 8 rollouts .* must be \[8\]"
    ):
        fresh_rollouts(plan, ids, mask, ids, mask, torch.zeros(7))
    with pytest.raises(ValueError, match=r"completion_mask has shape \[8, 2\].* \[8, width\] like its ids"):
        fresh_rollouts(plan, ids, mask, ids, torch.ones(8, 2), torch.zeros(8))


def test_a_sampler_that_samples_k_completions_per_prompt_is_told_in_its_terms():
    """A sampler written for inline GRPO (`generate(num_return_sequences=K)`) returns K rows per prompt."""

    class Sampler:
        def __call__(self, prompts, **columns):
            n = 3 * len(prompts)  # K = 3 completions of each prompt it was given
            ids, mask = torch.ones(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=torch.bool)
            return ids, mask, ids, mask, torch.zeros(n)

    stored = rows([7, 9], [1, 0], replayed=True)
    message = (
        "rollout_fn (Sampler) was given 10 prompts, each question already repeated (K = 3 times, K-1 = 2 "
        "for a replayed question), and returned 30 rows of prompt_ids, 3 per prompt: it must sample ONE "
        "completion per entry of `prompts`, since sample_groups does the repeating; drop "
        "num_return_sequences (or the repeat) from Sampler"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        sample_groups(batch(Experience("mix", stored)), 3, Sampler())
    with pytest.raises(
        ValueError, match=r"given 12 prompts, each question already repeated \(K = 3 times\),"
    ):
        sample_groups(batch(), 3, Sampler())


def test_record_behaviour_fills_fresh_rows_from_the_first_forward_and_keeps_replayed_ones():
    out = rows([0, 0, 1], [1, 0, 1], replayed=False)
    out.replayed = torch.tensor([False, False, True])
    out.completion_ids = torch.tensor([[1, 2], [1, 0], [2, 2]])
    out.completion_mask = torch.tensor([[True, True], [True, False], [True, True]])
    out.behaviour_logps = torch.full((3, 2), -0.5)
    logps = torch.tensor([[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]], requires_grad=True)
    logits = torch.zeros(3, 2, 4)  # uniform over 4 tokens: entropy log 4 everywhere
    logits[1, 0] = torch.tensor([0.0, 100.0, 0.0, 0.0])  # sure: entropy ~0 on row 1's only real token
    record_behaviour(out, logps, logits)
    assert out.behaviour_logps.tolist() == [[-1.0, -2.0], [-3.0, 0.0], [-0.5, -0.5]]  # padding 0, stored kept
    assert not out.behaviour_logps.requires_grad
    assert torch.allclose(out.entropy, torch.tensor([math.log(4), 0.0, 0.0]), atol=1e-6)  # row 2: stored 0
    with pytest.raises(ValueError, match=r"logps \[3, 1\] and logits \[3, 2, 4\] must be \[n, C\]"):
        record_behaviour(out, logps[:, :1], logits)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_micro_batches_record_and_weight_their_rows_as_the_whole_batch_does(size):
    """`rows=`: what `ExGRPOModule`'s micro-batched update calls equals one call on all rows."""
    g = torch.Generator().manual_seed(size)
    whole = rows([0, 0, 1, 1], [1, 0, 1, 0], replayed=False)
    whole.replayed = torch.tensor([False, True, False, True])
    whole.advantages = torch.tensor([0.5, -0.5, 1.0, -1.0])
    whole.completion_ids = torch.ones(4, 3, dtype=torch.long)
    whole.completion_mask = torch.rand(4, 3, generator=g) > 0.3
    whole.behaviour_logps = -torch.rand(4, 3, generator=g)
    parts = replace(whole, behaviour_logps=whole.behaviour_logps.clone(), entropy=whole.entropy.clone())
    logps, logits = -torch.rand(4, 3, generator=g), torch.randn(4, 3, 5, generator=g)
    per_token = torch.randn(4, 3, generator=g)
    record_behaviour(whole, logps, logits)
    expected = replayed_token_loss(per_token, logps, whole)
    pieces = []
    for start in range(0, 4, size):
        part = slice(start, start + size)
        record_behaviour(parts, logps[part], logits[part], rows=part)
        pieces.append(replayed_token_loss(per_token[part], logps[part], parts, rows=part))
    assert torch.equal(parts.behaviour_logps, whole.behaviour_logps)
    assert torch.equal(parts.entropy, whole.entropy)
    assert torch.equal(torch.cat(pieces), expected)


@settings(max_examples=50)
@given(
    st.lists(st.tuples(st.booleans(), st.floats(-2, 2)), min_size=1, max_size=6),
    st.sampled_from(["shaping", "truncate", "none"]),
    st.integers(0, 2**16),
)
def test_replayed_token_loss_on_a_clipped_surrogate_is_compute_grpo_loss(rows_spec, correction, seed):
    """A module's own clipped loss with `replayed_token_loss` is ExGRPO's loss: same value, same gradient."""
    g = torch.Generator().manual_seed(seed)
    n = len(rows_spec)
    replayed = torch.tensor([r for r, _ in rows_spec])
    advantages = torch.tensor([a for _, a in rows_spec])
    mask = torch.rand(n, 3, generator=g) > 0.3
    out = rows(list(range(n)), [0.0] * n)
    out.replayed, out.advantages, out.completion_mask = replayed, advantages, mask
    out.behaviour_logps = -torch.rand(n, 3, generator=g) * 2
    mine = (-torch.rand(n, 3, generator=g) * 2).requires_grad_()
    ratio = torch.exp(mine - mine.detach())
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    stats = {}
    per_token = replayed_token_loss(per_token, mine, out, correction, stats=stats)
    loss = (per_token * mask).sum() / max(int(mask.sum()), 1)
    (grad,) = torch.autograd.grad(loss, mine)

    theirs = mine.detach().clone().requires_grad_()
    weights = compute_importance_weights(theirs, out.behaviour_logps, mask, correction)
    expected, expected_stats = compute_grpo_loss(
        theirs, theirs.detach(), advantages, mask, LossNormaliser(n, int(mask.sum()), 3), loss_type="dapo",
        importance_weights=weights, replayed=replayed,
    )  # fmt: skip
    (expected_grad,) = torch.autograd.grad(expected, theirs)
    assert torch.allclose(loss, expected, atol=1e-6) and torch.allclose(grad, expected_grad, atol=1e-6)
    assert stats.keys() == ({"is_weight"} if replayed.any() else set())  # what train/is_weight logs
    if replayed.any():
        assert torch.allclose(stats["is_weight"], expected_stats["is_weight"], equal_nan=True)


def test_a_sampler_may_return_each_reward_functions_rewards_by_name():
    parts = {"accuracy": [1.0, 0.0, 1.0], "format": torch.tensor([0.5, 0.5, 0.0])}
    assert total_reward(parts).tolist() == [1.5, 0.5, 1.0]
    assert total_reward([1, 0]).dtype == torch.float32
    with pytest.raises(ValueError, match="empty mapping"):
        total_reward({})

"""TrajectoryBuffer: storage, eviction, keep modes, sampling strategies, statistics, state round trips, the
per-question index, de-duplication and replayed rows in mixed groups."""

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import RolloutBatch, pad_sequences, text_id
from exgrpo_pl.experience import DifficultyBucketer
from exgrpo_pl.experience.buffer import STRATEGIES, TrajectoryBuffer, resolve_strategy
from exgrpo_pl.experience.dedup import stored_hashes
from exgrpo_pl.ragged import GroupIndex


def make_batch(qids, rewards, entropy=None, replayed=None, domains=None, policy_version=0, seed=0):
    """Rows with random token payloads of varied lengths, padded the way the module pads them, and dataset
    columns of their questions as a verl row has them (`domain` too when there are domains)."""
    g = torch.Generator().manual_seed(seed)
    n = len(qids)
    prompts = [torch.randint(1, 1000, (int(k),), generator=g) for k in torch.randint(1, 5, (n,), generator=g)]
    completions = [
        torch.randint(1, 1000, (int(k),), generator=g) for k in torch.randint(1, 6, (n,), generator=g)
    ]
    prompt_ids, prompt_mask = pad_sequences(prompts, left=True)
    completion_ids, completion_mask = pad_sequences(completions, left=False)
    rewards = torch.tensor(rewards, dtype=torch.float32)
    return RolloutBatch(
        question_ids=torch.tensor(qids, dtype=torch.long),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logps=-torch.rand(completion_ids.shape, generator=g) * completion_mask,
        rewards=rewards,
        correct=rewards > 0.5,
        entropy=torch.rand(n, generator=g) if entropy is None else torch.tensor(entropy, dtype=torch.float32),
        advantages=torch.zeros(n),
        policy_version=torch.full((n,), policy_version, dtype=torch.long),
        replayed=torch.zeros(n, dtype=torch.bool) if replayed is None else torch.tensor(replayed),
        prompts=[f"prompt {q}" for q in qids],
        completions=[f"completion {seed}.{i}" for i in range(n)],
        answers=[f"answer {q}" for q in qids],
        domains=domains,
        columns={
            "answer": [f"answer {q}" for q in qids],
            "solution": [f"solution {q}" for q in qids],
            "extra_info": [{"index": q, "split": "train"} for q in qids],
            **({} if domains is None else {"domain": list(domains)}),
        },
    )


# The seed's opt-in: these tests exercise the strategies on every stored row, wrong answers included.
ANY = {"replayed_trajectories": "any_stored_including_incorrect"}


def group(qid, correct, total, **kwargs):
    """One question's group of `total` rollouts, the first `correct` of them correct."""
    return make_batch([qid] * total, [1.0] * correct + [0.0] * (total - correct), **kwargs)


def no_retire(**kwargs):
    return TrajectoryBuffer(bucketer=DifficultyBucketer(retire_from=None), **kwargs)


def roundtrip(state):
    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def assert_same_batch(a, b):
    for name in ("question_ids", "prompt_ids", "completion_ids", "behaviour_logps", "rewards", "entropy"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.prompts == b.prompts and a.completions == b.completions


def test_strategy_table_and_resolution():
    assert STRATEGIES["medium_difficulty_low_entropy"] == ("medium_range", "low_entropy_percentile")
    assert STRATEGIES["gaussian_lowest_entropy"] == ("gaussian", "lowest_entropy")
    assert resolve_strategy("entropy_guided") == ("medium_range", "low_entropy_percentile")
    assert resolve_strategy("gaussian_lowest_entropy", question_sampling="uniform") == (
        "uniform",
        "lowest_entropy",
    )
    assert resolve_strategy("gaussian_lowest_entropy", trajectory_selection="random") == (
        "gaussian",
        "random",
    )
    with pytest.raises(ValueError, match="gaussian_lowest_entropy"):
        resolve_strategy("best")
    with pytest.raises(ValueError, match="question_sampling"):
        resolve_strategy("uniform", question_sampling="hardest")
    with pytest.raises(ValueError, match="trajectory_selection"):
        resolve_strategy("uniform", trajectory_selection="longest")


def test_seed_dict_path():
    buffer = TrajectoryBuffer()
    for i in range(6):
        reward = float(i % 2)
        trajectory = {"prompt": f"what is {i}+{i}?", "rollout": str(2 * i), "reward": reward}
        trajectory.update(is_correct=reward > 0.5, entropy=0.1 * i)
        assert buffer.add(trajectory) == 1
    assert len(buffer) == 6
    expected_id = text_id("what is 3+3?")
    assert buffer.bucketer.rates(torch.tensor([expected_id])).item() == 1.0
    batch = buffer.sample("uniform", **ANY, size=10, generator=torch.Generator().manual_seed(0))
    assert len(batch) == 6 and batch.replayed.all()
    assert sorted(batch["prompts"]) == sorted(f"what is {i}+{i}?" for i in range(6))
    assert sorted(batch["rollouts"]) == sorted(str(2 * i) for i in range(6))
    assert sorted(batch["rewards"].tolist()) == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert batch.prompt_ids.shape == (6, 0) and batch.completion_mask.shape == (6, 0)
    with pytest.raises(ValueError, match="is_correct"):
        buffer.add({"prompt": "p", "rollout": "r", "reward": 1.0, "entropy": 0.0})


def test_seed_dict_with_tokens_and_metadata():
    buffer = TrajectoryBuffer()
    trajectory = dict(prompt="p", rollout="r", reward=torch.tensor(1.0), is_correct=torch.tensor(True))
    trajectory.update(entropy=torch.tensor(0.5), question_id=42, answer="a", policy_version=3, domain="math")
    trajectory.update(prompt_ids=torch.tensor([5, 6]), completion_ids=torch.tensor([7, 8, 9]))
    trajectory.update(behaviour_logps=torch.tensor([-0.1, -0.2, -0.3]))
    buffer.add(trajectory)
    batch = buffer.sample("uniform", size=1)
    assert batch.question_ids.tolist() == [42] and batch.answers == ["a"] and batch.domains == ["math"]
    assert batch.prompt_ids.tolist() == [[5, 6]] and batch.completion_ids.tolist() == [[7, 8, 9]]
    assert torch.allclose(batch.behaviour_logps, torch.tensor([[-0.1, -0.2, -0.3]]))
    assert batch.policy_version.tolist() == [3]


def test_sampled_rows_carry_their_payload():
    buffer = no_retire()
    source = make_batch(
        [1, 1, 2, 2, 3], [1.0, 0.0, 1.0, 1.0, 0.0], domains=["a", "a", "b", "b", "a"], policy_version=4
    )
    buffer.add(source)
    batch = buffer.sample(
        "uniform", **ANY, size=3, question_sampling="uniform", trajectory_selection="random"
    )
    for i in range(len(batch)):
        j = [k for k in range(len(source)) if source.completions[k] == batch.completions[i]][0]
        assert batch.question_ids[i] == source.question_ids[j]
        assert torch.equal(
            batch.prompt_ids[i][batch.prompt_mask[i]], source.prompt_ids[j][source.prompt_mask[j]]
        )
        assert torch.equal(
            batch.completion_ids[i][batch.completion_mask[i]],
            source.completion_ids[j][source.completion_mask[j]],
        )
        assert torch.equal(
            batch.behaviour_logps[i][batch.completion_mask[i]],
            source.behaviour_logps[j][source.completion_mask[j]],
        )
        assert batch.prompt_mask[i, -1] and batch.completion_mask[i, 0]  # left- and right-padded
        assert batch.domains[i] == source.domains[j] and batch.answers[i] == source.answers[j]
        rate = buffer.bucketer.rates(batch.question_ids[i : i + 1]).item()
        assert batch.advantages[i].item() == pytest.approx(batch.rewards[i].item() - rate)
    assert batch.group_size == 1 and batch.policy_version.tolist() == [4] * 3
    assert batch.prompt_ids.dtype == torch.long and batch.behaviour_logps.dtype == torch.float32


def test_eviction_is_oldest_first():
    buffer = TrajectoryBuffer(max_size=3)
    for version in range(5):
        buffer.add(make_batch([version], [0.0], policy_version=version))
    assert len(buffer) == 3
    assert sorted(buffer.policy_snapshot["policy_version"].tolist()) == [2, 3, 4]
    buffer.add(make_batch([10, 11, 12, 13], [0.0] * 4, policy_version=9))  # more than fits: the newest stay
    assert sorted(buffer.policy_snapshot["question_ids"].tolist()) == [11, 12, 13]
    buffer.remove_questions([12])
    buffer.add(make_batch([20], [0.0], policy_version=10))  # the freed slot is reused, nothing evicted
    assert sorted(buffer.policy_snapshot["question_ids"].tolist()) == [11, 13, 20]
    buffer.add(make_batch([21], [0.0], policy_version=11))
    assert sorted(buffer.policy_snapshot["question_ids"].tolist()) == [13, 20, 21]


def test_per_question_cap_evicts_that_questions_oldest_first():
    buffer = no_retire(max_per_question=2)
    for version in range(4):  # question 1 three times, question 2 once per round; new completions each time
        buffer.add(make_batch([1, 1, 1, 2], [0.0, 1.0, 0.0, 1.0], policy_version=version, seed=version))
    snapshot = buffer.policy_snapshot
    per_question = {
        q: sorted(v for qq, v in zip(snapshot["question_ids"].tolist(), snapshot["policy_version"].tolist())
                  if qq == q)
        for q in (1, 2)
    }  # fmt: skip
    assert per_question == {1: [3, 3], 2: [2, 3]}
    with pytest.raises(ValueError, match="max_per_question"):
        TrajectoryBuffer(max_per_question=0)


@pytest.mark.parametrize(
    ("keep", "expected"),
    [
        ("all", [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]),
        ("correct", [1, 1, 3, 3, 3, 3]),
        ("correct_of_partial", [1, 1]),
    ],
)
def test_keep_modes(keep, expected):
    buffer = no_retire(keep=keep)
    batch = RolloutBatch.cat([group(1, 2, 4), group(2, 0, 4), group(3, 4, 4)])
    assert buffer.add(batch) == len(expected)
    assert sorted(buffer.policy_snapshot["question_ids"].tolist()) == expected
    assert buffer.policy_snapshot["behaviour_logps"][0].dtype == torch.float32


def test_replayed_rows_are_ignored():
    buffer = TrajectoryBuffer()
    batch = make_batch([1, 1, 1, 2], [1.0, 1.0, 0.0, 1.0], replayed=[True, False, False, True])
    assert buffer.add(batch) == 2
    assert buffer.bucketer.known_questions().tolist() == [1]
    assert buffer.bucketer.rates(torch.tensor([1])).item() == 0.5
    assert buffer.add(make_batch([3], [1.0], replayed=[True])) == 0
    assert len(buffer) == 2


def test_retired_questions_are_removed_and_never_sampled():
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=8))
    buffer.add(RolloutBatch.cat([group(1, 2, 4), group(2, 2, 4)]))
    assert len(buffer) == 8
    assert buffer.add(group(1, 4, 4)) == 0  # solved by the whole group: retired, its rows dropped
    assert buffer.bucketer.retired == {1} and len(buffer) == 4
    assert buffer.stats()["retired"] == 1.0
    for name in STRATEGIES:
        batch = buffer.sample(name, size=8, difficulty_range=(0.0, 1.0), entropy_percentile=75)
        assert set(batch.question_ids.tolist()) <= {2}


def test_a_retired_question_that_fails_again_is_stored_again():
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=8, retire_from="buffer"))
    buffer.add(group(1, 4, 4))
    assert buffer.bucketer.retired == {1} and len(buffer) == 0
    assert buffer.add(group(1, 3, 4)) == 4  # keep="all": the whole group
    assert buffer.bucketer.retired == set() and len(buffer.sample("uniform", size=1)) == 1


def test_num_questions_in_counts_replayable_questions_by_rate():
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4))
    # rates 0, .25, .5, .75; question 4 solved by its group: retired, not replayable
    buffer.add(RolloutBatch.cat([group(q, q, 4) for q in range(5)]))
    assert buffer.num_questions_in((0.0, 1.0)) == 4
    assert buffer.num_questions_in((0.3, 0.7)) == 1
    assert buffer.num_questions_in((0.25, 0.75)) == 3
    assert TrajectoryBuffer().num_questions_in((0.0, 1.0)) == 0


def test_medium_range_filter():
    buffer = no_retire()
    buffer.add(RolloutBatch.cat([group(q, q, 4) for q in range(5)]))  # rates 0, .25, .5, .75, 1
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(20):
        batch = buffer.sample(
            "medium_difficulty_low_entropy", **ANY, size=4, trajectory_selection="random", generator=g
        )
        seen |= set(batch.question_ids.tolist())
        assert len(batch) == 1  # one eligible question, one trajectory per question
    assert seen == {2}
    batch = buffer.sample(
        "medium_difficulty_low_entropy", **ANY, size=50, difficulty_range=(0.25, 0.75), entropy_percentile=75
    )
    assert set(batch.question_ids.tolist()) <= {1, 2, 3}
    assert len(batch) == 9  # trajectory unit: 3/4 of the 12 candidates pass the 75th percentile


@pytest.mark.parametrize("strategy", [*STRATEGIES, "entropy_guided"])
def test_a_draw_among_given_questions_returns_one_stored_row_of_each_of_them_at_most(strategy):
    buffer = no_retire()
    buffer.add(RolloutBatch.cat([group(q, 2, 4) for q in range(6)]))  # every rate .5: all medium
    among = torch.tensor([1, 4, 99])  # 99: not held
    batch = buffer.sample(strategy, **ANY, size=10, questions=among, difficulty_range=(0.0, 1.0),
                          entropy_percentile=75, generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert sorted(batch.question_ids.tolist()) == [1, 4]  # one each, though the seed's unit is trajectories
    assert len(buffer.sample(strategy, **ANY, size=10, questions=torch.tensor([99]))) == 0
    assert buffer.num_questions_in((0.3, 0.7), among) == 2 and buffer.num_questions_in((0.3, 0.7)) == 6


def test_entropy_percentile_filter():
    buffer = no_retire()
    entropy = [float(e) for e in np.random.default_rng(0).permutation(100)]
    buffer.add(make_batch(list(range(50)) * 2, [1.0] * 50 + [0.0] * 50, entropy=entropy))  # every rate is 0.5
    threshold = np.percentile(entropy, 25)
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(30):
        batch = buffer.sample(**ANY, size=10, generator=g)
        assert len(batch) == 10 and (batch.entropy <= threshold).all()
        seen |= set(batch.entropy.tolist())
    assert seen == {e for e in entropy if e <= threshold}


@pytest.mark.parametrize("selection", ["lowest_entropy", "highest_entropy"])
def test_entropy_fn_wins_over_stored_entropy(selection):
    buffer = no_retire()
    buffer.add(make_batch([1, 1, 1, 2, 2, 2], [1, 0, 1, 0, 1, 0], entropy=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
    calls = []

    def reversed_entropy(candidates):
        calls.append(len(candidates))
        assert candidates.replayed.all()
        return -candidates.entropy  # the current policy disagrees with collection time

    batch = buffer.sample(
        **ANY,
        trajectory_selection=selection,
        question_sampling="uniform",
        size=2,
        entropy_fn=reversed_entropy,
    )
    expected = {0.3, 0.6} if selection == "lowest_entropy" else {0.1, 0.4}
    assert set(np.round(batch.entropy.tolist(), 4)) == expected and calls == [6]
    stored = buffer.sample(**ANY, trajectory_selection=selection, question_sampling="uniform", size=2)
    expected = {0.1, 0.4} if selection == "lowest_entropy" else {0.3, 0.6}
    assert set(np.round(stored.entropy.tolist(), 4)) == expected


def test_questions_with_one_stored_trajectory_are_not_rescored():
    buffer = no_retire()
    buffer.add(make_batch([1, 1, 2, 3], [1, 1, 1, 1], entropy=[0.1, 0.2, 0.3, 0.4]))
    scored = []

    def entropy_fn(candidates):
        scored.append(sorted(candidates.question_ids.tolist()))
        return torch.zeros(len(candidates))

    sample = {"question_sampling": "uniform", "entropy_fn": entropy_fn, "size": 3}
    batch = buffer.sample("gaussian_lowest_entropy", **sample)
    assert sorted(batch.question_ids.tolist()) == [1, 2, 3]
    buffer.remove_questions([1])
    assert len(buffer.sample("gaussian_lowest_entropy", **sample)) == 2
    assert scored == [[1, 1]]  # only question 1 had a choice, and only while it was stored


def test_official_pick_scores_every_candidate_in_order_and_takes_a_nan_first():
    """The official code scores all of the sampled questions' trajectories, singletons too, in one list
    (its chunks of 8 depend on the order), and its argmin returns a NaN score's index first."""
    buffer = no_retire()
    buffer.add(make_batch([1, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1], entropy=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]))
    scored = []
    scores = {0.1: 3.0, 0.2: 1.0, 0.3: 2.0, 0.4: 9.0, 0.5: 0.0, 0.6: float("nan")}

    def official(candidates):
        scored.append([round(e, 4) for e in candidates.entropy.tolist()])
        return torch.tensor([scores[round(e, 4)] for e in candidates.entropy.tolist()])

    batch = buffer.sample(
        "gaussian_lowest_entropy",
        trajectory_selection="official_inverted_mask_entropy",
        question_sampling="uniform",
        size=3,
        entropy_fn=official,
        generator=torch.Generator().manual_seed(0),
    )
    picked = dict(zip(batch.question_ids.tolist(), np.round(batch.entropy.tolist(), 4)))
    assert picked == {1: 0.2, 2: 0.4, 3: 0.6}
    (order,) = scored  # question after question in sampling order, each in stored order
    by_question = {1: [0.1, 0.2, 0.3], 2: [0.4], 3: [0.5, 0.6]}
    assert order == [e for q in batch.question_ids.tolist() for e in by_question[q]]
    with pytest.raises(ValueError, match="official_inverted_mask_entropy.*needs entropy_fn"):
        buffer.sample(
            "gaussian_lowest_entropy", trajectory_selection="official_inverted_mask_entropy", size=1
        )


def test_gaussian_sampling_matches_bucket_weights():
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=8))
    counts = [1, 2, 3, 4, 4, 5, 6, 7]  # two questions share the 0.5 bucket
    buffer.add(RolloutBatch.cat([group(q, c, 8) for q, c in enumerate(counts)]))
    rates = np.unique(np.array(counts) / 8)
    weight = np.exp(-((rates - 0.5) ** 2) / (2 * 0.125**2))
    g = torch.Generator().manual_seed(0)
    draws = [
        buffer.sample("gaussian_lowest_entropy", size=1, generator=g).question_ids.item() for _ in range(2000)
    ]
    drawn_rates = np.array(counts)[draws] / 8
    freq = np.array([np.mean(drawn_rates == r) for r in rates])
    np.testing.assert_allclose(freq, weight / weight.sum(), atol=0.03)
    everything = buffer.sample("gaussian_lowest_entropy", size=100, generator=g)
    assert sorted(everything.question_ids.tolist()) == list(range(8))  # without replacement, all of them


def test_fewer_eligible_than_size_and_empty():
    buffer = no_retire()
    for name in STRATEGIES:
        assert len(buffer.sample(name, **ANY, size=5)) == 0
    buffer.add(group(1, 2, 4))
    for name in STRATEGIES:
        batch = buffer.sample(name, **ANY, size=10, entropy_percentile=50)
        unit = 2 if name == "medium_difficulty_low_entropy" else 1  # trajectories vs questions
        assert len(batch) == unit
        assert len(buffer.sample(name, **ANY, size=0)) == 0
    assert (
        len(
            buffer.sample(
                "uniform", **ANY, size=3, difficulty_range=(0.9, 1.0), question_sampling="medium_range"
            )
        )
        == 0
    )


def test_sample_validation():
    buffer = TrajectoryBuffer()
    with pytest.raises(ValueError, match="entropy_percentile must be one of"):
        buffer.sample(size=1, entropy_percentile=10)
    with pytest.raises(ValueError, match="difficulty_range"):
        buffer.sample(size=1, difficulty_range=(0.7, 0.3))
    with pytest.raises(ValueError, match="size"):
        buffer.sample(size=-1)
    with pytest.raises(ValueError, match="gaussian_sigma"):
        buffer.sample("gaussian_lowest_entropy", size=1, gaussian_sigma=0.0)
    with pytest.raises(ValueError, match="strategy must be one of"):
        buffer.sample("hardest_first", size=1)


def test_constructor_validation():
    with pytest.raises(ValueError, match="max_size"):
        TrajectoryBuffer(max_size=0)
    with pytest.raises(ValueError, match="keep must be one of"):
        TrajectoryBuffer(keep="incorrect")
    with pytest.raises(ValueError, match="entropy_percentiles"):
        TrajectoryBuffer(entropy_percentiles=(50, 25))
    with pytest.raises(ValueError, match="difficulty_tiers"):
        TrajectoryBuffer(difficulty_tiers=0)
    with pytest.raises(TypeError, match="RolloutBatch"):
        TrajectoryBuffer().add([1, 2, 3])


def test_stats_and_accessors():
    buffer = no_retire(difficulty_tiers=4, entropy_percentiles=(50,))
    buffer.add(make_batch([1, 1, 2, 2], [1.0, 0.0, 0.0, 0.0], entropy=[0.1, 0.2, 0.3, 0.4], policy_version=2))
    buffer.add(make_batch([3, 3], [1.0, 1.0], entropy=[0.5, 0.6], policy_version=5))
    stats = buffer.stats(current_version=6)
    assert stats["size"] == 6.0 and stats["num_questions"] == 3.0 and stats["retired"] == 0.0
    assert stats["tier_counts"].tolist() == [2, 0, 2, 2]  # rates 0.5, 0.5, 0, 0, 1, 1
    assert stats["entropy_band_edges"].tolist() == pytest.approx([0.35])
    assert stats["entropy_band_counts"].tolist() == [3, 3]
    assert stats["staleness_mean"] == pytest.approx((4 * 4 + 2 * 1) / 6) and stats["staleness_max"] == 4.0
    assert "staleness_mean" not in buffer.stats()
    assert sorted(buffer.entropies().tolist()) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert sorted(buffer.rates().tolist()) == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0]
    assert sorted(buffer.staleness(6).tolist()) == [1, 1, 4, 4, 4, 4]
    buffer.clear()
    assert len(buffer) == 0 and buffer.stats()["size"] == 0.0
    assert buffer.bucketer.rates(torch.tensor([3])).item() == 1.0  # difficulty history survives clear()


def filled_buffer(max_size=64):
    """A buffer that went through evictions and removals, so its slots have holes."""
    buffer = TrajectoryBuffer(max_size=max_size, bucketer=DifficultyBucketer(window_size=8))
    rng = np.random.default_rng(0)
    for step in range(12):
        qids = [int(q) for q in rng.integers(0, 20, size=3)]
        parts = [
            group(q, int(rng.integers(0, 4)), 4, seed=step * 10 + i, policy_version=step)
            for i, q in enumerate(qids)
        ]
        domains = ["math" if q % 2 else "code" for q in qids for _ in range(4)]
        batch = RolloutBatch.cat(parts)
        batch.domains = domains
        buffer.add(batch)
        if step == 6:
            buffer.remove_questions([qids[0]])
    return buffer


def test_state_dict_round_trip_is_exact():
    buffer = filled_buffer()
    state = buffer.state_dict()
    restored = TrajectoryBuffer(max_size=64, bucketer=DifficultyBucketer(window_size=8))
    restored.load_state_dict(roundtrip(state))
    assert len(restored) == len(buffer)
    assert_same(restored.state_dict(), state)
    for name in STRATEGIES:
        a = buffer.sample(
            name, size=16, generator=torch.Generator().manual_seed(3), difficulty_range=(0.2, 0.8)
        )
        b = restored.sample(
            name, size=16, generator=torch.Generator().manual_seed(3), difficulty_range=(0.2, 0.8)
        )
        assert_same_batch(a, b)
        assert a.domains == b.domains
    more = make_batch([5, 5, 99, 99], [1.0, 0.0, 1.0, 0.0], seed=7)
    buffer.add(more)
    restored.add(more)
    assert_same(restored.state_dict(), buffer.state_dict())


def test_load_into_smaller_buffer_keeps_newest():
    buffer = filled_buffer()
    state = roundtrip(buffer.state_dict())
    small = TrajectoryBuffer(max_size=10)
    small.load_state_dict(state)
    assert len(small) == 10
    newest = state["seq"][-10:].tolist()
    assert small.state_dict()["seq"].tolist() == newest
    assert small.stats()["size"] == 10.0
    small.add(make_batch([100], [1.0]))
    assert len(small) == 10 and 100 in small.policy_snapshot["question_ids"].tolist()


@settings(max_examples=40)
@given(
    st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=6), min_size=1, max_size=8),
    st.integers(1, 12),
    st.sampled_from(sorted(STRATEGIES)),
)
def test_invariants_under_random_adds(groups, max_size, strategy):
    buffer = TrajectoryBuffer(max_size=max_size, bucketer=DifficultyBucketer(window_size=4))
    rng = np.random.default_rng(len(groups))
    for step, qids in enumerate(groups):
        buffer.add(make_batch(qids, [float(r) for r in rng.integers(0, 2, len(qids))], seed=step))
        assert len(buffer) <= max_size
        assert len(buffer) == len(buffer.entropies()) == len(buffer.policy_snapshot["behaviour_logps"])
    batch = buffer.sample(
        strategy, size=5, difficulty_range=(0.0, 1.0), generator=torch.Generator().manual_seed(0)
    )
    assert not set(batch.question_ids.tolist()) & buffer.bucketer.retired
    if strategy != "medium_difficulty_low_entropy":
        assert len(set(batch.question_ids.tolist())) == len(batch)  # one trajectory per question
    assert len(set(batch.completions)) == len(batch)


# ---------------------------------------------------------------------------------------- per-question index
def index_from_scratch(buffer):
    """The per-question index recomputed from the columns: occupied slots of known questions by question,
    oldest first inside each."""
    cols = buffer._storage.cols
    occupied = np.flatnonzero(cols["occupied"])
    occupied = occupied[np.argsort(cols["seq"][occupied], kind="stable")]
    qidx = cols["qidx"][occupied]
    return GroupIndex.build(occupied[qidx >= 0], qidx[qidx >= 0])


def assert_index_consistent(buffer):
    """The per-question index and the eviction order equal their recomputation; hashes too, and no question
    holds a completion twice (with `dedup`)."""
    expected = index_from_scratch(buffer)
    num_questions = len(buffer.bucketer)
    storage = buffer._storage
    assert np.array_equal(storage.index.members, expected.members)
    assert np.array_equal(storage.index.counts(num_questions), expected.counts(num_questions))
    occupied = np.flatnonzero(storage.cols["occupied"])
    oldest_first = occupied[np.argsort(storage.cols["seq"][occupied])]
    assert np.array_equal(storage.fifo_live()[0], oldest_first)  # the eviction order
    # Every add here carries columns: one entry per stored question, gone with its last trajectory.
    assert set(storage.columns) == set(storage.cols["question_id"][occupied].tolist())
    if buffer.dedup:
        assert np.array_equal(storage.cols["hash"][occupied], stored_hashes(storage, occupied))
        completion = storage.tokens["completion"]
        keys = {
            (int(q), tuple(completion.rows(np.array([s]))["completion_ids"].tolist()))
            for q, s in zip(storage.cols["question_id"][occupied], occupied)
            if completion.length[s] > 0
        }
        stored = int((completion.length[occupied] > 0).sum())
        assert len(keys) == stored  # no question holds the same completion twice


# Each operation: ("add", (question ids, payload seed)), ("remove", question), ("reload", new max_size)
# or ("clear", 0). Payload seeds repeat on purpose: the same seed and questions give duplicate completions.
buffer_operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 3)),
        ),
        st.tuples(st.just("remove"), st.integers(0, 5)),
        st.tuples(st.just("reload"), st.integers(1, 14)),
        st.tuples(st.just("clear"), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=60)
@given(buffer_operations, st.integers(1, 12), st.sampled_from([None, 1, 2]), st.booleans())
def test_index_equals_a_recomputation_after_any_sequence(ops, max_size, max_per_question, dedup):
    """Adds (with oldest-first and per-question eviction, retirement and duplicates), removals, reloads into
    buffers of another size and clears leave the index exactly as recomputed from the columns."""

    def new_buffer(size):
        bucketer = DifficultyBucketer(window_size=4, min_retire_group=3)
        return TrajectoryBuffer(
            max_size=size, bucketer=bucketer, max_per_question=max_per_question, dedup=dedup
        )

    buffer = new_buffer(max_size)
    rng = np.random.default_rng(len(ops))
    for kind, arg in ops:
        if kind == "add":
            qids, seed = arg
            buffer.add(make_batch(qids, [float(r) for r in rng.integers(0, 2, len(qids))], seed=seed))
        elif kind == "remove":
            buffer.remove_questions([arg])
        elif kind == "reload":
            state = roundtrip(buffer.state_dict())
            buffer = new_buffer(arg)
            buffer.load_state_dict(state)
        else:
            buffer.clear()
        assert_index_consistent(buffer)
        assert len(buffer) <= buffer.max_size
        assert not set(buffer.policy_snapshot["question_ids"].tolist()) & buffer.bucketer.retired


def test_eviction_queue_drops_what_removals_left_behind():
    buffer = no_retire(max_size=3000, dedup=False)
    for first in (0, 2100):  # 4200 stored and removed again: stale entries of the eviction queue
        questions = list(range(first, first + 2100))
        buffer.add(make_batch(questions, [1.0] * 2100))
        assert buffer.remove_questions(questions) == 2100
    buffer.add(make_batch([1, 2], [1.0, 0.0], seed=1))
    assert len(buffer) == 2 and buffer._storage.fifo_length == 2
    buffer.add(make_batch(list(range(10, 3009)), [1.0] * 2999, seed=2))  # one more than fits
    assert sorted(buffer.policy_snapshot["question_ids"].tolist()) == [2, *range(10, 3009)]
    assert_index_consistent(buffer)


def test_index_follows_a_bucketer_loaded_elsewhere():
    """A shared bucketer that loads a state reassigns dense indices; the buffer re-derives its index."""
    bucketer = DifficultyBucketer(retire_from=None)
    buffer = TrajectoryBuffer(bucketer=bucketer)
    buffer.add(make_batch([5, 5, 7], [1.0, 0.0, 1.0]))
    other = DifficultyBucketer(retire_from=None)
    other.update(torch.tensor([9, 7, 5]), torch.tensor([1.0, 1.0, 0.0]))  # 7 and 5 get other indices
    bucketer.load_state_dict(other.state_dict())
    batch = buffer.sample("uniform", size=5)
    assert sorted(batch.question_ids.tolist()) == [5, 7]
    assert_index_consistent(buffer)
    assert buffer.remove_questions([5]) == 2 and len(buffer) == 1
    assert_index_consistent(buffer)


def test_rows_of_questions_the_bucketer_forgot_can_still_be_removed():
    bucketer = DifficultyBucketer(retire_from=None)
    buffer = TrajectoryBuffer(bucketer=bucketer)
    buffer.add(make_batch([5, 6], [1.0, 0.0]))
    bucketer.load_state_dict(DifficultyBucketer().state_dict())  # knows no question now
    assert len(buffer.sample("uniform", size=5)) == 0  # unknown questions are never sampled
    assert buffer.remove_questions([5]) == 1 and len(buffer) == 1
    assert_index_consistent(buffer)


def test_random_selection_is_uniform_inside_a_question():
    buffer = no_retire()
    buffer.add(make_batch([1, 1, 1, 2], [1.0, 0.0, 1.0, 0.0], entropy=[0.1, 0.2, 0.3, 0.4]))
    g = torch.Generator().manual_seed(0)
    picked = [
        round(float(e), 1)
        for _ in range(3000)
        for q, e in zip(*(lambda b: (b.question_ids.tolist(), b.entropy.tolist()))(
            buffer.sample("uniform", **ANY, size=2, generator=g)))
        if q == 1
    ]  # fmt: skip
    assert len(picked) == 3000
    for e in (0.1, 0.2, 0.3):
        assert abs(picked.count(e) / 3000 - 1 / 3) < 0.03


def test_question_sampling_with_the_percentile_filter():
    """An ablation pair: questions drawn uniformly among those with a trajectory under the percentile, then
    one of those trajectories uniformly."""
    buffer = no_retire(entropy_percentiles=(50,))
    entropy = [0.1, 0.2, 0.9, 0.8, 0.7, 0.05, 0.6, 0.3]
    buffer.add(make_batch([1, 1, 1, 2, 2, 3, 3, 3], [1.0, 0.0] * 4, entropy=entropy))
    threshold = np.percentile(entropy, 50)  # 0.45: question 2 has nothing under it
    g = torch.Generator().manual_seed(0)
    seen = {}
    for _ in range(2000):
        batch = buffer.sample(
            "uniform",
            **ANY,
            size=5,
            trajectory_selection="low_entropy_percentile",
            entropy_percentile=50,
            generator=g,
        )
        assert sorted(batch.question_ids.tolist()) == [1, 3] and (batch.entropy <= threshold).all()
        for q, e in zip(batch.question_ids.tolist(), batch.entropy.tolist(), strict=True):
            seen[(q, round(e, 2))] = seen.get((q, round(e, 2)), 0) + 1
    assert set(seen) == {(1, 0.1), (1, 0.2), (3, 0.05), (3, 0.3)}
    assert all(abs(n / 2000 - 0.5) < 0.04 for n in seen.values())


# ------------------------------------------------------------------------------------------ de-duplication
def test_a_repeated_completion_replaces_the_stored_copy():
    buffer = no_retire()
    assert buffer.add(make_batch([1, 1, 2], [1.0, 0.0, 1.0], seed=0, policy_version=1)) == 3
    repeat = make_batch([1, 1, 2], [1.0, 0.0, 1.0], seed=0, policy_version=5)  # the same completions
    repeat.question_ids[2] = 3  # ... but the third now answers another question
    assert buffer.add(repeat) == 3
    snapshot = buffer.policy_snapshot
    stored = sorted(zip(snapshot["question_ids"].tolist(), snapshot["policy_version"].tolist()))
    assert stored == [(1, 5), (1, 5), (2, 1), (3, 5)]  # question 1's copies are the newest ones
    assert buffer.state_dict()["seq"].tolist() == [2, 3, 4, 5]  # the replaced ones moved to the back
    seed_buffer = no_retire(dedup=False)  # the seed's buffer keeps both copies
    seed_buffer.add(make_batch([1, 1, 2], [1.0, 0.0, 1.0], seed=0))
    seed_buffer.add(make_batch([1, 1, 2], [1.0, 0.0, 1.0], seed=0))
    assert len(seed_buffer) == 6


def test_duplicates_inside_a_batch_collapse_to_the_last():
    buffer = no_retire()
    batch = make_batch([1, 1, 1, 2, 2], [1.0, 0.0, 1.0, 1.0, 1.0], entropy=[0.1, 0.2, 0.3, 0.4, 0.5])
    for source, target in ((0, 2), (3, 4)):  # row 2 repeats row 0's completion, row 4 repeats row 3's
        batch.completion_ids[target] = batch.completion_ids[source]
        batch.completion_mask[target] = batch.completion_mask[source]
    batch.completion_ids[1] = batch.completion_ids[0]
    batch.completion_mask[1] = batch.completion_mask[0]
    batch.completion_ids[1, 0] += 1  # one token off: not a duplicate
    assert buffer.add(batch) == 3
    assert sorted(np.round(buffer.entropies().tolist(), 1)) == [0.2, 0.3, 0.5]


def test_dedup_compares_ids_exactly_when_hashes_collide(monkeypatch):
    """With every hash equal, only true duplicates collapse."""
    import exgrpo_pl.experience.dedup as dedup_module

    monkeypatch.setattr(dedup_module, "row_hashes", lambda ids, lengths: np.zeros(len(lengths), np.uint64))
    buffer = no_retire()
    batch = make_batch([1, 1, 1, 1, 2], [1.0, 0.0, 1.0, 0.0, 1.0], entropy=[0.1, 0.2, 0.3, 0.4, 0.5])
    batch.completion_ids[3], batch.completion_mask[3] = batch.completion_ids[1], batch.completion_mask[1]
    assert buffer.add(batch) == 4  # rows 0, 2, 3 (for row 1) and question 2
    again = RolloutBatch.cat([batch.select([2]), make_batch([2], [1.0], seed=9)])  # row 2 again, a new one
    again.entropy = torch.tensor([0.6, 0.7])
    assert buffer.add(again) == 2
    assert sorted(np.round(buffer.entropies().tolist(), 1)) == [0.1, 0.4, 0.5, 0.6, 0.7]


def test_trajectories_without_completion_ids_are_duplicates_by_their_text():
    buffer = no_retire()
    for prompt, rollout, entropy in [("p", "a", 0.1), ("p", "b", 0.2), ("p", "a", 0.3), ("q", "a", 0.4)]:
        trajectory = {"prompt": prompt, "rollout": rollout, "reward": 1.0, "is_correct": True}
        assert buffer.add({**trajectory, "entropy": entropy}) == 1
    # p's second "a" replaced its first (the newest copy stays); q's "a" is another question's.
    state = buffer.state_dict()  # rows oldest first
    kept = list(zip(state["prompts"], state["completions"], np.round(state["entropy"].tolist(), 1).tolist()))
    assert kept == [("p", "b", 0.2), ("p", "a", 0.3), ("q", "a", 0.4)]
    with_ids = {"prompt": "p", "rollout": "a", "reward": 1.0, "is_correct": True, "entropy": 0.5}
    buffer.add({**with_ids, "completion_ids": [7]})  # compared by its ids, not with the text-only rows
    assert len(buffer) == 4
    seed_buffer = no_retire(dedup=False)  # the seed's buffer keeps both copies
    for _ in range(2):
        seed_buffer.add({"prompt": "p", "rollout": "a", "reward": 1.0, "is_correct": True, "entropy": 0.1})
    assert len(seed_buffer) == 2


def test_a_state_with_duplicates_loads_whole_and_the_next_copy_replaces_them():
    seed_buffer = no_retire(dedup=False)
    seed_buffer.add(make_batch([1, 1], [1.0, 0.0], seed=0, policy_version=1))
    seed_buffer.add(make_batch([1, 1], [1.0, 0.0], seed=0, policy_version=2))
    buffer = no_retire()
    buffer.load_state_dict(roundtrip(seed_buffer.state_dict()))
    assert len(buffer) == 4
    assert buffer.add(make_batch([1, 1], [1.0, 0.0], seed=0, policy_version=3)) == 2
    assert sorted(buffer.policy_snapshot["policy_version"].tolist()) == [3, 3]
    assert_index_consistent(buffer)


# ---------------------------------------------------------------------------- replayed rows in mixed groups
def mixed_group(qid, replayed_reward, fresh_rewards, seed=0):
    """A mix-mode group: the stored row first (replayed), then the fresh rollouts of the same question."""
    rewards = [replayed_reward, *fresh_rewards]
    batch = make_batch(
        [qid] * len(rewards), rewards, replayed=[True] + [False] * len(fresh_rewards), seed=seed
    )
    batch.group_size = len(rewards)
    return batch


def test_a_replayed_row_counts_in_its_groups_outcomes_but_is_not_stored():
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=8))
    batch = RolloutBatch.cat([mixed_group(1, 1.0, [0.0, 1.0, 0.0]), mixed_group(2, 0.0, [0.0, 0.0, 1.0])])
    assert batch.group_size == 4
    assert buffer.add(batch) == 6  # the fresh rows only
    correct, total = buffer.bucketer.latest_counts(torch.tensor([1, 2]))
    assert correct.tolist() == [2, 1] and total.tolist() == [4, 4]
    assert buffer.bucketer.rates(torch.tensor([1, 2])).tolist() == [0.5, 0.25]
    assert not buffer.policy_snapshot["question_ids"].eq(0).any()
    assert sorted(buffer.policy_snapshot["question_ids"].tolist()) == [1, 1, 1, 2, 2, 2]


def test_swap_batches_and_strangers_in_a_group_update_nothing():
    buffer = TrajectoryBuffer()
    swap = make_batch([1, 2, 3], [1.0, 1.0, 0.0], replayed=[True, True, True])  # group_size 1
    assert buffer.add(swap) == 0 and len(buffer.bucketer) == 0
    stranger = make_batch([7, 8, 8], [1.0, 1.0, 0.0], replayed=[True, False, False])
    stranger.group_size = 3  # the replayed row's question has no fresh row in its group
    buffer.add(stranger)
    assert buffer.bucketer.known_questions().tolist() == [8]
    assert buffer.bucketer.latest_counts(torch.tensor([8]))[1].tolist() == [2]


def test_a_mixed_group_solved_by_all_k_retires_its_question():
    bucketer = DifficultyBucketer(min_retire_group=4)  # three fresh rows alone could not retire it
    buffer = TrajectoryBuffer(bucketer=bucketer)
    buffer.add(group(1, 1, 2))
    assert buffer.add(mixed_group(1, 1.0, [1.0, 1.0, 1.0])) == 0
    assert bucketer.retired == {1} and len(buffer) == 0


@pytest.mark.parametrize(
    ("replayed_reward", "fresh", "stored"),
    [
        (0.0, [1.0, 1.0, 1.0], 3),  # 3/4 is partial (3/3 of the fresh rows alone would retire it)
        (1.0, [0.0, 0.0, 0.0], 0),  # 1/4 is partial, but no fresh row is correct
        (1.0, [1.0, 0.0, 0.0], 1),  # 2/4
        (1.0, [1.0, 1.0, 1.0], 0),  # 4/4: solved, retired
    ],
)
def test_correct_of_partial_counts_the_whole_group(replayed_reward, fresh, stored):
    buffer = TrajectoryBuffer(keep="correct_of_partial", bucketer=DifficultyBucketer(window_size=8))
    assert buffer.add(mixed_group(1, replayed_reward, fresh)) == stored
    assert buffer.bucketer.latest_counts(torch.tensor([1]))[1].tolist() == [4]
    assert buffer.bucketer.retired == ({1} if stored == 0 and sum(fresh) == 3 else set())


@settings(max_examples=40)
@given(
    correct=st.lists(st.lists(st.booleans(), min_size=1, max_size=4), min_size=1, max_size=6),
    strategy=st.sampled_from(sorted(STRATEGIES)),
    seed=st.integers(0, 2**16),
)
def test_only_correct_rows_are_replayed_from_a_keep_all_buffer(correct, strategy, seed):
    """Whatever `keep="all"` stored, a draw returns correct rows only, and every question with a correct row
    can be drawn (the default `replayed_trajectories="correct"`)."""
    buffer = no_retire()  # keep="all": wrong answers are stored too
    qids = [q for q, rows in enumerate(correct) for _ in rows]
    rewards = [float(c) for rows in correct for c in rows]
    buffer.add(make_batch(qids, rewards, entropy=[0.01 * i for i in range(len(qids))]))
    g = torch.Generator().manual_seed(seed)
    batch = buffer.sample(
        strategy, size=100, difficulty_range=(0.0, 1.0), entropy_percentile=75, generator=g,
        entropy_fn=lambda candidates: candidates.entropy,
    )  # fmt: skip
    assert bool(batch.correct.all())
    with_correct = {q for q, rows in enumerate(correct) if any(rows)}
    assert set(batch.question_ids.tolist()) <= with_correct
    if strategy in ("gaussian_lowest_entropy", "uniform"):  # every eligible question, one row each
        assert sorted(batch.question_ids.tolist()) == sorted(with_correct)
    everything = buffer.sample(strategy, **ANY, size=100, difficulty_range=(0.0, 1.0), entropy_percentile=75)
    assert len(everything) >= len(batch)

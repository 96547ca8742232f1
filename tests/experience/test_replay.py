"""SelectiveReplay: the replay coin flip, sampling through a buffer, adaptive range and state round trips."""

import ast
import io
from pathlib import Path

import numpy as np
import pytest
import torch

import exgrpo_pl
from exgrpo_pl.batch import RolloutBatch, pad_sequences
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay
from exgrpo_pl.experience.buffer import QUESTION_SAMPLING, TRAJECTORY_SELECTION, TrajectoryBuffer


def make_group(qid, correct, total, entropy):
    """One question's group: the first `correct` rows correct, one-token prompts and completions."""
    rewards = torch.tensor([1.0] * correct + [0.0] * (total - correct))
    prompt_ids, prompt_mask = pad_sequences([torch.tensor([qid + 1])] * total, left=True)
    completion_ids, completion_mask = pad_sequences([torch.tensor([i + 1]) for i in range(total)], left=False)
    return RolloutBatch(
        question_ids=torch.full((total,), qid),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        behaviour_logps=torch.zeros(total, 1),
        rewards=rewards,
        correct=rewards > 0.5,
        entropy=torch.tensor(entropy, dtype=torch.float32),
        advantages=torch.zeros(total),
        policy_version=torch.zeros(total, dtype=torch.long),
        replayed=torch.zeros(total, dtype=torch.bool),
        group_size=total,
    )


def make_buffer(counts, total=4):
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=total))
    for q, c in enumerate(counts):
        buffer.add(make_group(q, c, total, entropy=[0.1 * (q + 1) + 0.01 * i for i in range(total)]))
    return buffer


def roundtrip(state):
    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


def test_should_replay_frequency_and_same_seed_agreement():
    a, b = SelectiveReplay(replay_probability=0.3, seed=5), SelectiveReplay(replay_probability=0.3, seed=5)
    decisions = [a.should_replay() for _ in range(5000)]
    assert decisions == [b.should_replay() for _ in range(5000)]
    assert abs(np.mean(decisions) - 0.3) < 0.02
    other = SelectiveReplay(replay_probability=0.3, seed=6)
    assert [other.should_replay() for _ in range(5000)] != decisions
    assert not any(SelectiveReplay(replay_probability=0.0).should_replay() for _ in range(200))
    assert all(SelectiveReplay(replay_probability=1.0).should_replay() for _ in range(200))


def test_sampling_does_not_shift_the_decision_stream():
    a, b = SelectiveReplay(seed=1), SelectiveReplay(seed=1)
    buffer = make_buffer([2, 1, 3])
    decisions_a, decisions_b = [], []
    for _ in range(50):
        decisions_a.append(a.should_replay())
        a.sample(buffer, size=4)  # a rank whose buffer differs still decides in lockstep
        decisions_b.append(b.should_replay())
    assert decisions_a == decisions_b


def test_entropy_guided_is_the_seed_strategy():
    replay = SelectiveReplay()
    assert replay.strategy == "entropy_guided"
    assert (replay.question_sampling, replay.trajectory_selection) == (
        "medium_range",
        "low_entropy_percentile",
    )
    assert replay.replay_probability == 0.3 and replay.medium_difficulty_range == (0.3, 0.7)
    buffer = make_buffer([0, 2, 4, 2])
    batch = replay.sample(buffer, size=10)
    assert set(batch.question_ids.tolist()) <= {1, 3} and batch.replayed.all()
    assert (batch.entropy <= np.percentile(buffer.entropies()[buffer.rates() == 0.5].numpy(), 25)).all()


def test_paper_strategy_with_entropy_fn_and_ablation_overrides():
    buffer = make_buffer([1, 2, 3])
    replay = SelectiveReplay(strategy="gaussian_lowest_entropy")
    batch = replay.sample(buffer, size=3, entropy_fn=lambda candidates: -candidates.entropy)
    assert sorted(batch.question_ids.tolist()) == [0, 1, 2]
    # The highest stored entropy of each question's correct rows (the first 1, 2, 3 of its 4).
    assert torch.allclose(batch.entropy.sort().values, torch.tensor([0.10, 0.21, 0.32]))
    seed = SelectiveReplay(
        strategy="gaussian_lowest_entropy", replayed_trajectories="any_stored_including_incorrect"
    )
    batch = seed.sample(buffer, size=3, entropy_fn=lambda candidates: -candidates.entropy)
    assert torch.allclose(batch.entropy.sort().values, torch.tensor([0.13, 0.23, 0.33]))  # wrong ones too
    no_selection = SelectiveReplay(strategy="gaussian_lowest_entropy", trajectory_selection="random")
    assert (no_selection.question_sampling, no_selection.trajectory_selection) == ("gaussian", "random")
    no_question = SelectiveReplay(strategy="gaussian_lowest_entropy", question_sampling="uniform")
    assert sorted(no_question.sample(buffer, size=5).question_ids.tolist()) == [0, 1, 2]


@pytest.mark.parametrize("question_sampling", QUESTION_SAMPLING)
@pytest.mark.parametrize("selection", TRAJECTORY_SELECTION)
def test_rescores_says_whether_sample_calls_entropy_fn(question_sampling, selection):
    """The replay callback pads ZeRO-3 ranks' rescoring forwards only when `rescores` says so."""
    replay = SelectiveReplay(question_sampling=question_sampling, trajectory_selection=selection)
    calls = []
    replay.sample(make_buffer([1, 2, 3]), size=3, entropy_fn=lambda c: calls.append(len(c)) or c.entropy)
    assert replay.rescores == bool(calls)


def test_replayed_trajectories_is_checked_by_name():
    with pytest.raises(ValueError, match="replayed_trajectories='all'"):
        SelectiveReplay(replayed_trajectories="all")


def test_same_seed_samples_the_same():
    buffer = make_buffer([1, 2, 3, 2, 1, 3, 2])
    a = SelectiveReplay(strategy="gaussian_lowest_entropy", seed=3)
    b = SelectiveReplay(strategy="gaussian_lowest_entropy", seed=3)
    for _ in range(5):
        assert (
            a.sample(buffer, size=3).question_ids.tolist() == b.sample(buffer, size=3).question_ids.tolist()
        )


def test_adaptive_range_follows_the_median():
    buffer = make_buffer([7, 7, 6, 7], total=8)  # rates .875, .875, .75, .875: nothing in (0.3, 0.7)
    assert len(SelectiveReplay().sample(buffer, size=8)) == 0
    adaptive = SelectiveReplay(adaptive_range=True)
    assert adaptive.medium_range(buffer) == pytest.approx((0.6, 1.0))
    assert len(adaptive.sample(buffer, size=8)) > 0


def test_state_dict_round_trip():
    buffer = make_buffer([1, 2, 3, 2, 1])
    a = SelectiveReplay(strategy="uniform", seed=9)
    for _ in range(7):
        a.should_replay()
        a.sample(buffer, size=2)
    state = roundtrip(a.state_dict())
    assert state["decision_generator"].dtype == torch.uint8
    b = SelectiveReplay(strategy="uniform", seed=0)
    b.load_state_dict(state)
    assert [a.should_replay() for _ in range(20)] == [b.should_replay() for _ in range(20)]
    assert a.sample(buffer, size=3).question_ids.tolist() == b.sample(buffer, size=3).question_ids.tolist()


def test_validation_errors():
    with pytest.raises(ValueError, match="entropy_guided"):
        SelectiveReplay(strategy="greedy")
    with pytest.raises(ValueError, match="replay_probability"):
        SelectiveReplay(replay_probability=1.5)
    with pytest.raises(ValueError, match="medium_difficulty_range"):
        SelectiveReplay(medium_difficulty_range=(0.5, 1.2))
    with pytest.raises(ValueError, match="gaussian_sigma"):
        SelectiveReplay(gaussian_sigma=-1.0)
    with pytest.raises(ValueError, match="trajectory_selection"):
        SelectiveReplay(trajectory_selection="shortest")


def test_core_modules_import_no_framework():
    """validation, ragged <- rate_tiers, bucket_draw <- difficulty <- buffer <- replay (and seeding) import
    only the stdlib, NumPy, torch and one another."""
    allowed = {
        "__future__", "collections", "heapq", "math", "numbers", "os", "warnings", "zlib", "numpy", "torch",
    }  # fmt: skip
    package = Path(exgrpo_pl.__file__).parent
    own = {
        "experience.difficulty": {
            "experience.bucket_draw", "experience.rate_order", "experience.rate_tiers", "validation",
        },
        "experience.rate_order": set(),
        "experience.rate_tiers": set(),
        "experience.bucket_draw": {"ragged"},
        "ragged": set(),
        "experience.buffer": {
            "batch", "experience.dedup", "experience.sampling", "experience.storage", "experience.difficulty",
            "experience.incoming", "experience.row_layout", "validation",
        },
        "experience.incoming": {"batch", "experience.row_layout"},
        "experience.row_layout": {"batch", "ragged"},
        "experience.storage": {"batch", "experience.difficulty", "experience.row_layout", "ragged"},
        "experience.sampling": {"batch", "experience.storage", "experience.difficulty"},
        "experience.dedup": {"experience.row_layout", "experience.storage", "ragged"},
        "experience.replay": {"batch", "experience.buffer", "experience.difficulty", "seeding", "validation"},
        "seeding": set(),
        "validation": set(),
    }  # fmt: skip
    for name, internal in own.items():
        source = package.joinpath(*name.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module]
            else:
                continue
            for module in modules:
                top, _, rest = module.partition(".")
                assert top in allowed or (top == "exgrpo_pl" and rest in internal), (
                    f"exgrpo_pl.{name} imports {module}"
                )

"""TrajectoryBuffer's dataset columns: kept once per question, dropped with its last stored trajectory, handed
to sampled rows, through a checkpoint loaded with weights_only, and rejected when a checkpoint cannot hold
them."""

import datetime
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_buffer import assert_same, group, make_batch, mixed_group, roundtrip

from exgrpo_pl.experience import DifficultyBucketer, TrajectoryBuffer


def verl_columns(q):
    """What a verl row's question carries besides its prompt (`answer` from reward_model.ground_truth)."""
    return {
        "answer": f"answer {q}",
        "solution": f"solution {q}",
        "extra_info": {"index": q, "split": "train"},
    }


def with_columns(batch, **columns):
    """`batch` with these columns (name -> one value per row) instead of its own."""
    return replace(batch, columns={key: list(values) for key, values in columns.items()})


def no_retire(**kwargs):
    return TrajectoryBuffer(bucketer=DifficultyBucketer(retire_from=None), **kwargs)


def test_columns_are_kept_once_per_question_as_copies():
    buffer = no_retire()
    batch = make_batch([1, 1, 1, 2, 2], [1.0, 0.0, 0.0, 1.0, 0.0])
    assert buffer.add(batch) == 5
    assert buffer.question_columns(1) == verl_columns(1) and buffer.question_columns(2) == verl_columns(2)
    state = buffer.state_dict()
    assert state["column_question_ids"].tolist() == [1, 2] and len(state["columns"]) == 2  # not 5
    # A copy: what the batch's objects become later is not what the buffer keeps.
    batch.columns["extra_info"][0]["index"] = 99
    assert buffer.question_columns(1)["extra_info"] == {"index": 1, "split": "train"}
    assert buffer.question_columns(3) is None


def test_the_newest_batch_of_a_question_replaces_its_columns():
    buffer = no_retire()
    buffer.add(group(1, 1, 2))
    newer = with_columns(group(1, 0, 2, seed=1), answer=["a", "a"], solution=["s", "s"])
    buffer.add(newer)
    assert buffer.question_columns(1) == {"answer": "a", "solution": "s"}


def test_columns_leave_with_the_last_trajectory_of_their_question():
    buffer = no_retire(max_size=4)
    buffer.add(group(1, 1, 2))
    buffer.add(group(2, 1, 2, seed=1))
    buffer.add(group(3, 1, 1, seed=2))  # evicts the oldest row, question 1's first: one is left
    assert buffer.question_columns(1) == verl_columns(1)
    buffer.add(group(4, 1, 1, seed=3))  # evicts question 1's last row
    assert buffer.question_columns(1) is None and buffer.question_columns(2) == verl_columns(2)
    assert buffer.remove_questions([2]) == 2 and buffer.question_columns(2) is None
    buffer.clear()
    assert buffer.question_columns(3) is None and buffer.state_dict()["columns"] == []


def test_a_retired_question_drops_its_columns():
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(min_retire_group=2))
    buffer.add(group(1, 1, 2))
    assert buffer.question_columns(1) == verl_columns(1)
    buffer.add(group(1, 2, 2, seed=1))  # solved by the whole group: retired, its rows removed
    assert buffer.bucketer.retired == {1} and len(buffer) == 0 and buffer.question_columns(1) is None


def test_the_per_question_cap_keeps_the_columns_of_a_question_it_leaves_rows_of():
    buffer = no_retire(max_per_question=1)
    buffer.add(group(1, 1, 3))
    assert len(buffer) == 1 and buffer.question_columns(1) == verl_columns(1)


def test_sampled_rows_carry_their_questions_columns_and_rows_stored_without_have_answer_and_domain():
    buffer = no_retire()
    buffer.add(make_batch([1, 1], [1.0, 0.0]))
    without = make_batch([2, 2], [1.0, 0.0], domains=["math", "math"], seed=1)
    without.columns = None  # a module whose rollouts carry no columns
    buffer.add(without)
    sampled = buffer.sample("uniform", size=4, generator=torch.Generator().manual_seed(0))
    by_question = {
        q: {key: values[i] for key, values in sampled.columns.items()}
        for i, q in enumerate(sampled.question_ids.tolist())
    }
    assert set(sampled.columns) == {"answer", "solution", "extra_info", "domain"}  # the union of keys
    assert by_question[1] == {**verl_columns(1), "domain": None}
    assert by_question[2] == {"answer": "answer 2", "domain": "math", "solution": None, "extra_info": None}


def test_columns_survive_a_checkpoint_loaded_with_weights_only():
    buffer = no_retire(max_size=6)
    values = {
        "answer": 7,
        "solution": "$\\frac{1}{2}$",
        "extra_info": {"index": 3, "split": "train", "tags": ["a", None], "pair": (1, 2.5), 4: True},
        "vector": torch.tensor([1.5, -2.0]),
        "missing": None,
    }
    for q in (1, 2, 3):
        batch = group(q, 1, 3, seed=q)
        buffer.add(with_columns(batch, **{key: [value] * 3 for key, value in {**values, "q": q}.items()}))
    state = buffer.state_dict()
    loaded = roundtrip(state)  # torch.load(weights_only=True)
    restored = no_retire(max_size=6)
    restored.load_state_dict(loaded)
    assert_same(restored.state_dict(), state)
    for q in (2, 3):  # question 1's rows were evicted by question 3's
        got = restored.question_columns(q)
        assert got.keys() == {**values, "q": q}.keys() and got["extra_info"] == values["extra_info"]
        assert torch.equal(got["vector"], values["vector"]) and got["answer"] == 7 and got["q"] == q
    assert restored.question_columns(1) is None
    small = no_retire(max_size=3)  # keeps question 3's rows only, and only its columns
    small.load_state_dict(loaded)
    assert small.state_dict()["column_question_ids"].tolist() == [3] and small.question_columns(2) is None


def test_a_state_saved_before_columns_were_kept_loads_with_answers_and_domains():
    buffer = no_retire()
    buffer.add(make_batch([1, 1], [1.0, 0.0], domains=["code", "code"]))
    state = buffer.state_dict()
    del state["column_question_ids"], state["columns"]
    restored = no_retire()
    restored.load_state_dict(roundtrip(state))
    sampled = restored.sample("uniform", size=1)
    assert sampled.columns == {"answer": ["answer 1"], "domain": ["code"]}


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (np.float64(0.5), r"column 'solution' of question_id=1: value is a numpy.float64"),
        ([1, np.int64(2)], r"value\[1\] is a numpy.int64"),
        ({"when": datetime.date(2024, 1, 1)}, r"value\['when'\] is a datetime.date"),
        ({(1, 2): "pair"}, r"a key of value is a builtins.tuple"),
        ({1, 2}, r"value is a builtins.set"),
    ],
)
def test_a_value_a_checkpoint_cannot_hold_is_rejected_before_anything_changes(value, named):
    buffer = no_retire()
    batch = with_columns(group(1, 1, 2), answer=["a", "a"], solution=[value, value])
    with pytest.raises(TypeError, match=named) as error:
        buffer.add(batch)
    assert "torch.load(weights_only=True)" in str(error.value)
    assert len(buffer) == 0 and len(buffer.bucketer) == 0  # nothing stored, no outcome recorded


def test_the_columns_of_a_mixed_group_come_from_its_fresh_rows():
    buffer = no_retire()
    mixed = mixed_group(1, 1.0, [0.0, 1.0])
    mixed.columns["solution"][0] = np.float64(1.0)  # the replayed row's: never stored, so never checked
    assert buffer.add(mixed) == 2 and buffer.question_columns(1) == verl_columns(1)

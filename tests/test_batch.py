"""RolloutBatch dtype checks, sequences, cat and dataset columns; stored_column_value; pad_sequences: exact
cases and a row-by-row reference."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import RolloutBatch, pad_sequences, stored_column_value


def test_left_and_right_padding_exact():
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4]), torch.tensor([], dtype=torch.long)]
    right, right_mask = pad_sequences(rows, left=False, pad_value=9)
    assert right.tolist() == [[1, 2, 3], [4, 9, 9], [9, 9, 9]]
    assert right_mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    left, left_mask = pad_sequences(rows, left=True, pad_value=9)
    assert left.tolist() == [[1, 2, 3], [9, 9, 4], [9, 9, 9]]
    assert left_mask.tolist() == [[True, True, True], [False, False, True], [False, False, False]]
    empty, empty_mask = pad_sequences([], left=True)
    assert empty.shape == empty_mask.shape == (0, 0)


@settings(max_examples=50)
@given(st.lists(st.lists(st.floats(-5, 5), max_size=6), min_size=1, max_size=8), st.booleans())
def test_matches_row_by_row_reference(values, left):
    rows = [torch.tensor(v, dtype=torch.float32) for v in values]
    out, mask = pad_sequences(rows, left=left, pad_value=-1.0)
    width = max(len(v) for v in values)
    for row, v, m in zip(out.tolist(), values, mask.tolist(), strict=True):
        pad = [-1.0] * (width - len(v))
        expected = (
            pad + torch.tensor(v, dtype=torch.float32).tolist() if left else torch.tensor(v).tolist() + pad
        )
        assert row == expected
        assert m == ([False] * len(pad) + [True] * len(v) if left else [True] * len(v) + [False] * len(pad))


def rollout_batch(n=2, **overrides):
    fields = dict(
        question_ids=torch.arange(n),
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        completion_ids=torch.ones(n, 3, dtype=torch.long),
        completion_mask=torch.ones(n, 3, dtype=torch.bool),
        behaviour_logps=torch.zeros(n, 3),
        rewards=torch.zeros(n),
        correct=torch.zeros(n, dtype=torch.bool),
        entropy=torch.zeros(n),
        advantages=torch.zeros(n),
        policy_version=torch.zeros(n, dtype=torch.long),
        replayed=torch.zeros(n, dtype=torch.bool),
    )
    return RolloutBatch(**{**fields, **overrides})


@pytest.mark.parametrize(
    "name, example",
    [
        ("prompt_mask", r"a tokenizer's attention_mask.bool\(\)"),
        ("completion_mask", r"completion_mask.bool\(\)"),
        ("correct", "rewards > 0.5"),
        ("replayed", "torch.zeros"),
    ],
)
def test_integer_masks_and_flags_are_rejected_saying_they_must_be_bool(name, example):
    good = rollout_batch()
    with pytest.raises(
        TypeError, match=rf"RolloutBatch.{name} is torch.int64; {name} must be bool \(e.g. {example}"
    ):
        rollout_batch(**{name: getattr(good, name).long()})


def test_sequences_are_what_a_forward_reads():
    batch = rollout_batch()
    assert batch.sequences == (
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
    )


def test_cat_keeps_one_text_per_row_when_a_part_has_none():
    with_texts = rollout_batch(prompts=["a", "b"], completions=["x", "y"], answers=["1", "2"])
    without = rollout_batch(n=1)
    out = RolloutBatch.cat([without, with_texts])
    assert (
        out.prompts == ["", "a", "b"] and out.completions == ["", "x", "y"] and out.answers == ["", "1", "2"]
    )
    assert RolloutBatch.cat([without, without]).prompts == []  # no texts anywhere: still none


def test_columns_follow_their_rows_through_cat_and_select():
    a = rollout_batch(2, columns={"answer": ["1", "2"], "extra_info": [{"i": 0}, {"i": 1}]})
    b = rollout_batch(1, columns={"answer": ["3"], "only_b": [[5]]})
    c = rollout_batch(1)  # carries no columns
    out = RolloutBatch.cat([a, b, c]).select([3, 2, 0])
    # The union of keys, None where a part lacks one.
    assert out.columns == {
        "answer": [None, "3", "1"],
        "extra_info": [None, None, {"i": 0}],
        "only_b": [None, [5], None],
    }
    assert RolloutBatch.cat([c, c]).columns is None and c.select([0]).columns is None
    with pytest.raises(ValueError, match=r"RolloutBatch.columns\['answer'\] has 1 values for 2 rows"):
        rollout_batch(2, columns={"answer": ["x"]})


def test_logged_extra_follows_its_rows_through_cat_and_select_apart_from_the_columns():
    fresh = rollout_batch(2, columns={"answer": ["1", "2"]}, extra={"judge": ["ok", "no"]})
    stored = rollout_batch(1, columns={"answer": ["3"]})  # a stored row: no extra
    out = RolloutBatch.cat([stored, fresh]).select([2, 0])
    assert out.extra == {"judge": ["no", None]} and out.columns == {"answer": ["2", "3"]}
    assert RolloutBatch.cat([stored, stored]).extra is None
    with pytest.raises(ValueError, match=r"RolloutBatch.extra\['judge'\] has 1 values for 2 rows"):
        rollout_batch(2, extra={"judge": ["x"]})


def test_stored_column_value_copies_all_the_way_down():
    weight = torch.nn.Parameter(torch.ones(2))
    value = {"a": [1, 2.5, "s", None, True], "t": (weight, {3: -1})}
    copy = stored_column_value(value, "column 'x'")
    assert copy["a"] == value["a"] and copy["a"] is not value["a"] and copy["t"][1] == {3: -1}
    assert type(copy["t"]) is tuple and type(copy["t"][0]) is torch.Tensor  # a plain tensor, detached
    assert not copy["t"][0].requires_grad and torch.equal(copy["t"][0], weight.detach())
    weight.data.fill_(2.0)
    assert copy["t"][0].tolist() == [1.0, 1.0]


def test_stored_column_value_names_what_a_checkpoint_cannot_hold():
    with pytest.raises(TypeError, match=r"column 'x': value\['t'\]\[1\] is a numpy.float32 "):
        stored_column_value({"t": [0.5, np.float32(1.0)]}, "column 'x'")

"""pad_sequences: exact small cases and agreement with a row-by-row reference."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import pad_sequences


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


@settings(max_examples=50, deadline=None)
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

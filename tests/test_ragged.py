"""RaggedStore, GroupIndex and row_hashes: rows survive writes, releases and compaction; padding matches
pad_sequences; the index matches a dict of lists; hashes depend on each row alone."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import pad_sequences
from exgrpo_pl.ragged import GARBAGE_FRACTION, ROW_COPY_WIDTH, GroupIndex, RaggedStore, row_hashes


def store_with(rows: dict[int, np.ndarray]) -> RaggedStore:
    store = RaggedStore({"ids": np.int32, "logps": np.float32})
    store.reserve_slots(max(rows, default=-1) + 1)
    slots = np.array(sorted(rows), dtype=np.int64)
    lengths = np.array([len(rows[s]) for s in slots], dtype=np.int64)
    flat = np.concatenate([rows[s] for s in slots] or [np.zeros(0, np.int32)])
    store.write(slots, lengths, {"ids": flat, "logps": -flat.astype(np.float32)})
    return store


# Each operation: ("write", rows of lengths for fresh slots) or ("release", which stored slots by position).
operations = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.lists(st.integers(0, 9), min_size=1, max_size=6)),
        st.tuples(st.just("release"), st.lists(st.integers(0, 50), max_size=6)),
    ),
    max_size=25,
)


@settings(max_examples=60)
@given(operations)
def test_rows_survive_writes_releases_and_compaction(ops):
    store = RaggedStore({"ids": np.int32, "logps": np.float32})
    reference: dict[int, np.ndarray] = {}
    next_slot, counter = 0, 1
    for kind, args in ops:
        if kind == "write":
            slots = np.arange(next_slot, next_slot + len(args))
            next_slot += len(args)
            store.reserve_slots(next_slot)
            rows = [np.arange(counter, counter + n, dtype=np.int32) for n in args]
            counter += sum(args)
            flat = np.concatenate(rows)
            store.write(slots, np.array(args, dtype=np.int64), {"ids": flat, "logps": flat * 0.5})
            reference.update(zip(slots.tolist(), rows, strict=True))
            assert store.end - store.live <= GARBAGE_FRACTION * store.live  # holes stay bounded
        elif reference:
            stored = sorted(reference)
            gone = np.unique([stored[i % len(stored)] for i in args]).astype(np.int64)
            store.release(gone)
            for slot in gone.tolist():
                del reference[slot]
        assert store.live == sum(len(r) for r in reference.values())
        slots = np.array(sorted(reference), dtype=np.int64)
        got = store.rows(slots)
        want = np.concatenate([reference[s] for s in slots.tolist()] or [np.zeros(0, np.int32)])
        assert np.array_equal(got["ids"], want) and np.array_equal(got["logps"], want * 0.5)


@settings(max_examples=40)
@given(st.lists(st.integers(0, 7), max_size=10), st.booleans())
def test_padded_matches_pad_sequences(lengths, left):
    rows = {i: np.arange(1, n + 1, dtype=np.int32) * (i + 1) for i, n in enumerate(lengths)}
    store = store_with(rows)
    order = np.arange(len(lengths), dtype=np.int64)[::-1].copy()  # any slot order
    padded, mask = store.padded(order, left=left)
    ref, ref_mask = pad_sequences([torch.from_numpy(rows[i]).long() for i in order.tolist()], left=left)
    assert torch.equal(torch.from_numpy(padded["ids"]).long(), ref)
    assert torch.equal(torch.from_numpy(padded["logps"]), -ref.float())
    assert torch.equal(torch.from_numpy(mask), ref_mask)
    wide, wide_mask = store.padded(order, left=left, dtypes={"ids": np.int64})
    assert wide["ids"].dtype == np.int64 and wide["logps"].dtype == np.float32
    assert torch.equal(torch.from_numpy(wide["ids"]), ref) and np.array_equal(wide_mask, mask)


@pytest.mark.parametrize("left", [False, True])
@pytest.mark.parametrize("lengths", [[300, 0, 257, 5], [ROW_COPY_WIDTH, 3], [ROW_COPY_WIDTH - 1, 3], [0, 0]])
def test_padded_wide_and_narrow_rows_match_pad_sequences(lengths, left):
    """Both ways of padding: slice copies (ROW_COPY_WIDTH and wider) and one gather (narrower)."""
    rows = {i: np.arange(1, n + 1, dtype=np.int32) * (i + 1) for i, n in enumerate(lengths)}
    store = store_with(rows)
    order = np.array([1, 0, *range(2, len(lengths))], dtype=np.int64)
    padded, mask = store.padded(order, left=left, dtypes={"ids": np.int64})
    ref, ref_mask = pad_sequences([torch.from_numpy(rows[i]).long() for i in order.tolist()], left=left)
    assert torch.equal(torch.from_numpy(padded["ids"]), ref) and padded["ids"].dtype == np.int64
    assert torch.equal(torch.from_numpy(padded["logps"]), -ref.float())
    assert torch.equal(torch.from_numpy(mask), ref_mask)


def test_release_is_idempotent_and_ignores_free_slots():
    store = store_with({0: np.array([1, 2], np.int32), 1: np.array([3], np.int32)})
    store.release(np.array([0, 0]))
    store.release(np.array([0]))
    assert store.live == 1
    assert store.rows(np.array([1]))["ids"].tolist() == [3]


def test_group_index_by_hand():
    index = GroupIndex.build(np.array([10, 11, 12, 13]), np.array([2, 0, 2, 0]))
    assert index.members.tolist() == [11, 13, 10, 12]  # key order, given order inside a key
    assert index.counts(4).tolist() == [2, 0, 2, 0]
    index.add(np.array([14, 15]), np.array([1, 0]))
    assert index.members.tolist() == [11, 13, 15, 14, 10, 12]
    members, lengths = index.groups(np.array([2, 5, 0]))
    assert members.tolist() == [10, 12, 11, 13, 15] and lengths.tolist() == [2, 0, 3]
    members, lengths = index.groups(np.array([0, 2]), first=np.array([2, 1]))
    assert members.tolist() == [11, 13, 10] and lengths.tolist() == [2, 1]
    index.remove(np.array([13, 10]), np.array([0, 2]))
    assert index.members.tolist() == [11, 15, 14, 12] and index.counts(3).tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match="found under their keys"):
        index.remove(np.array([14]), np.array([0]))  # 14 is under key 1
    with pytest.raises(ValueError, match=">= 0"):
        index.add(np.array([1]), np.array([-1]))


# Each operation: ("add", keys of fresh members) or ("remove", which current members by position).
index_operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 70), min_size=1, max_size=8)),
        st.tuples(st.just("remove"), st.lists(st.integers(0, 100), max_size=8)),
    ),
    max_size=30,
)


@settings(max_examples=60)
@given(index_operations)
def test_group_index_matches_a_dict_of_lists(ops):
    index = GroupIndex()
    reference: dict[int, list[int]] = {}
    key_of: dict[int, int] = {}
    next_member = 0
    for kind, args in ops:
        if kind == "add":
            members = np.arange(next_member, next_member + len(args))
            next_member += len(args)
            index.add(members, np.array(args))
            for m, k in zip(members.tolist(), args, strict=True):
                reference.setdefault(k, []).append(m)
                key_of[m] = k
        elif key_of:
            present = sorted(key_of)
            gone = sorted({present[i % len(present)] for i in args})
            index.remove(np.array(gone, dtype=np.int64), np.array([key_of[m] for m in gone], dtype=np.int64))
            for m in gone:
                reference[key_of.pop(m)].remove(m)
        keys = sorted(reference)
        assert index.members.tolist() == [m for k in keys for m in reference[k]]
        assert index.counts(71).tolist() == [len(reference.get(k, [])) for k in range(71)]
        present = np.array(sorted(key_of), dtype=np.int64)  # ascending = insertion order
        rebuilt = GroupIndex.build(present, np.array([key_of[m] for m in present.tolist()], dtype=np.int64))
        assert np.array_equal(rebuilt.members, index.members)


def test_row_hashes_by_hand():
    rows = [[5], [5, 0], [0], [], [0, 5], [5], [1, 2, 3]]
    lengths = np.array([len(r) for r in rows])
    hashes = row_hashes(np.array([v for r in rows for v in r], dtype=np.int32), lengths)
    assert hashes.dtype == np.uint64 and hashes[0] == hashes[5]
    assert len(set(hashes.tolist())) == 6  # padding-like zeros, order and length all count
    assert row_hashes(np.zeros(0, np.int32), np.zeros(0, np.int64)).shape == (0,)


@settings(max_examples=60)
@given(st.lists(st.lists(st.integers(0, 50_000), max_size=12), max_size=10))
def test_row_hash_depends_on_the_row_alone(rows):
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    flat = np.array([v for r in rows for v in r], dtype=np.int32)
    together = row_hashes(flat, lengths)
    alone = [row_hashes(np.array(r, dtype=np.int32), np.array([len(r)]))[0] for r in rows]
    assert together.tolist() == [int(h) for h in alone]
    for a, b, ha, hb in zip(rows, rows[1:], together, together[1:], strict=False):
        assert (ha == hb) == (a == b)  # no collision among these few rows

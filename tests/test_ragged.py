"""RaggedStore: rows by slot survive writes, releases and compaction; padding matches pad_sequences."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.batch import pad_sequences
from exgrpo_pl.ragged import GARBAGE_FRACTION, RaggedStore


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


@settings(max_examples=60, deadline=None)
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


@settings(max_examples=40, deadline=None)
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


def test_release_is_idempotent_and_ignores_free_slots():
    store = store_with({0: np.array([1, 2], np.int32), 1: np.array([3], np.int32)})
    store.release(np.array([0, 0]))
    store.release(np.array([0]))
    assert store.live == 1
    assert store.rows(np.array([1]))["ids"].tolist() == [3]

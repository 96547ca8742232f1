"""RaggedStore: variable-length rows addressed by slot, stored back to back in flat NumPy arrays.

The replay buffer keeps up to 100K trajectories of up to thousands of tokens. One NumPy array per row would
cost an object header per row; here every field is one flat array and a row is (offset, length), so
gathering 256 padded rows is one gather of short rows or one contiguous slice copy per long row. Freed rows
leave holes that are compacted away once they exceed 1/16 of the live payload, so the payload's resident
memory stays within 1.0625x of it (benchmarks/buffer.py: 1.21x overall after evicting half a 100K buffer,
metadata, per-question index and hashes included; at 1/8 it was 1.26x; compaction copies the live rows,
which the adds when full pay for).

`GroupIndex` keeps the buffer's slots grouped by question, so the trajectories of 256 sampled questions are
found without scanning 100K rows; `row_hashes` gives the 64-bit completion hash that the buffer's
de-duplication compares first. Plain NumPy, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

GARBAGE_FRACTION = 1 / 16  # compact when freed-but-not-reclaimed elements exceed this share of live ones
# `padded` gathers rows narrower than this with one indexing op over every position, and copies wider ones
# one slice per row. On rows not in cache (as sampling finds them), 256 rows: 64-token prompts 0.14 ms
# gathered vs 0.22 ms by slices; <= 512-token completions (ids and log-probs) 0.59 ms by slices vs 0.78 ms
# gathered (the slices read only real elements, the gather every padded position).
ROW_COPY_WIDTH = 256


class RaggedStore:
    """Rows of one or more fields that share a length (e.g. completion ids and their log-probs), by slot.

    Args:
        dtypes: field name -> NumPy dtype of its elements.
    """

    def __init__(self, dtypes: Mapping[str, type]) -> None:
        self.fields = {name: np.zeros(0, dtype=dtype) for name, dtype in dtypes.items()}
        self.offset = np.zeros(0, dtype=np.int64)
        self.length = np.zeros(0, dtype=np.int64)
        self.stored = np.zeros(0, dtype=np.bool_)
        self.end = 0  # elements in use at the front of every field array, holes included
        self.live = 0  # elements of stored rows

    def reserve_slots(self, n: int) -> None:
        """Make room for slots `0..n-1`."""
        grow = n - len(self.offset)
        if grow > 0:
            self.offset = np.append(self.offset, np.zeros(grow, dtype=np.int64))
            self.length = np.append(self.length, np.zeros(grow, dtype=np.int64))
            self.stored = np.append(self.stored, np.zeros(grow, dtype=np.bool_))

    def write(self, slots: np.ndarray, lengths: np.ndarray, flat: Mapping[str, np.ndarray]) -> None:
        """Store rows at free `slots`; row i has `lengths[i]` elements, `flat[name]` has them back to back."""
        total = int(lengths.sum())
        self._make_room(total)
        for name, values in flat.items():
            self.fields[name][self.end : self.end + total] = values
        self.offset[slots] = self.end + np.cumsum(lengths) - lengths
        self.length[slots] = lengths
        self.stored[slots] = True
        self.end += total
        self.live += total

    def release(self, slots: np.ndarray) -> None:
        """Forget the rows at `slots` (their elements become holes until the next compaction)."""
        slots = np.unique(slots)
        slots = slots[self.stored[slots]]
        self.live -= int(self.length[slots].sum())
        self.stored[slots] = False
        self.length[slots] = 0

    def rows(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at `slots`, concatenated in that order, per field."""
        index = ragged_index(self.offset[slots], self.length[slots])
        return {name: values[index] for name, values in self.fields.items()}

    def padded(
        self, slots: np.ndarray, left: bool, dtypes: Mapping[str, type] | None = None
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows at `slots` zero-padded to the longest (on the left or right), per field, and the
        `[len(slots), width]` mask of real elements.

        Args:
            slots: `[n]` stored slots, in the order of the output rows.
            left: pad on the left (rows end at the last column) instead of the right.
            dtypes: field name -> dtype of its padded output (the stored dtype otherwise).
        """
        lengths = self.length[slots]
        n, width = len(slots), int(lengths.max(initial=0))
        positions = np.arange(width)
        mask = positions >= (width - lengths)[:, None] if left else positions < lengths[:, None]  # [n, width]
        dtypes = dtypes or {}
        if width < ROW_COPY_WIDTH:
            # One gather of every position; padding reads a clipped neighbour and is zeroed after.
            first = self.offset[slots] - (width - lengths if left else 0)
            index = np.clip(first[:, None] + positions, 0, max(self.end - 1, 0))  # [n, width]
            out = {}
            for name, values in self.fields.items():
                rows = values[index].astype(dtypes.get(name, values.dtype), copy=False)
                rows[~mask] = 0
                out[name] = rows
            return out, mask
        # Each row is contiguous in its arena: one slice copy per row and field reads only its own elements.
        out = {name: np.zeros(n * width, dtypes.get(name, v.dtype)) for name, v in self.fields.items()}
        pairs = [(out[name], values) for name, values in self.fields.items()]
        targets = (np.arange(n) * width + (width - lengths if left else 0)).tolist()
        for target, first, length in zip(targets, self.offset[slots].tolist(), lengths.tolist(), strict=True):
            for flat, values in pairs:
                flat[target : target + length] = values[first : first + length]
        return {name: flat.reshape(n, width) for name, flat in out.items()}, mask

    @property
    def capacity(self) -> int:
        return len(next(iter(self.fields.values())))

    def _make_room(self, total: int) -> None:
        if self.end - self.live > GARBAGE_FRACTION * self.live:
            self._compact()
        if self.end + total > self.capacity:
            # Doubling keeps growth copies amortised O(1) per element; the untouched tail of a freshly zeroed
            # array is not resident memory, so the headroom costs address space only.
            self._copy_into(max(2 * self.capacity, self.end + total, 1024), [(0, self.end, 0)])

    def _compact(self) -> None:
        """Close the holes: move the stored rows to the front, keeping their order."""
        slots = np.flatnonzero(self.stored)
        slots = slots[np.argsort(self.offset[slots], kind="stable")]
        starts, lengths = self.offset[slots], self.length[slots]
        targets = np.cumsum(lengths) - lengths
        self.offset[slots] = targets
        # Rows that were adjacent stay adjacent: one copy per run of them (one run after FIFO eviction).
        breaks = np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1
        runs = np.split(np.arange(len(slots)), breaks) if len(slots) else []
        spans = [(int(starts[r[0]]), int(starts[r[-1]] + lengths[r[-1]]), int(targets[r[0]])) for r in runs]
        self._copy_into(self.capacity, spans)
        self.end = self.live

    def _copy_into(self, capacity: int, spans: list[tuple[int, int, int]]) -> None:
        """Fresh zeroed arrays of `capacity` elements holding each element span [start, stop) at target."""
        for name, values in self.fields.items():
            fresh = np.zeros(capacity, dtype=values.dtype)
            for start, stop, target in spans:
                fresh[target : target + stop - start] = values[start:stop]
            self.fields[name] = fresh


class GroupIndex:
    """Members (buffer slots) grouped by a dense key (question index), each group in the order it was given.

    All groups lie back to back in `members`, in key order: group `k` is
    `members[start[k] : start[k] + count[k]]`. Adding or removing a few members costs one copy of `members`
    (a vectorised memmove) and one cumulative sum over the keys, instead of a scan of every stored row at
    each look-up; looking up the members of some keys costs only their number.

    Attributes:
        members: `[total]` int64 members, grouped by key.
        count: `[num_keys]` int64 members per key (grown as larger keys arrive; keys past it have none).
        start: `[num_keys]` int64 position of each key's group in `members`.
    """

    def __init__(self) -> None:
        self.members = np.zeros(0, dtype=np.int64)
        self.count = np.zeros(0, dtype=np.int64)
        self.start = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.members)

    @classmethod
    def build(cls, members: np.ndarray, keys: np.ndarray) -> GroupIndex:
        """An index of `members` (`[n]`, in the order each group should keep) under `keys` (`[n]`, >= 0)."""
        index = cls()
        index.add(members, keys)
        return index

    def counts(self, num_keys: int) -> np.ndarray:
        """`[num_keys]` members per key, zeros for keys never added."""
        if len(self.count) >= num_keys:
            return self.count[:num_keys]
        return np.append(self.count, np.zeros(num_keys - len(self.count), dtype=np.int64))

    def add(self, members: np.ndarray, keys: np.ndarray) -> None:
        """Append `members` to the groups `keys`, after the members already there, in the given order."""
        if not len(members):
            return
        order = np.argsort(keys, kind="stable")
        members, keys = np.asarray(members, dtype=np.int64)[order], np.asarray(keys, dtype=np.int64)[order]
        if keys[0] < 0:
            raise ValueError(f"GroupIndex keys must be >= 0, got {int(keys[0])}")
        self._grow(int(keys[-1]) + 1)
        # The end of each key's group; np.insert keeps equal positions in the given order.
        self.members = np.insert(self.members, self.start[keys] + self.count[keys], members)
        self.count += np.bincount(keys, minlength=len(self.count))
        self._restart()

    def remove(self, members: np.ndarray, keys: np.ndarray) -> None:
        """Drop `members`, each from its group `keys`; every one must be in the index under its key."""
        if not len(members):
            return
        keys = np.asarray(keys, dtype=np.int64)
        groups = np.unique(keys)
        positions = ragged_index(self.start[groups], self.count[groups])  # the affected groups only
        gone = positions[np.isin(self.members[positions], members)]
        if len(gone) != len(members):
            raise ValueError(
                f"GroupIndex.remove: {len(members)} members given, {len(gone)} found under their keys"
            )
        self.members = np.delete(self.members, gone)
        self.count -= np.bincount(keys, minlength=len(self.count))
        self._restart()

    def groups(self, keys: np.ndarray, first: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The members of `keys` (`[k]`), key after key, and how many each key gave.

        Args:
            keys: `[k]` keys, any order, repeats allowed.
            first: `[k]` how many members to take from the front of each group (the whole group when None).

        Returns:
            `[sum]` members and `[k]` int64 their number per key.
        """
        self._grow(int(keys.max(initial=-1)) + 1)
        lengths = self.count[keys]
        if first is not None:
            lengths = np.minimum(lengths, first)
        return self.members[ragged_index(self.start[keys], lengths)], lengths

    def _grow(self, num_keys: int) -> None:
        """Room for keys `0..num_keys-1` (doubling: questions arrive a few at a time)."""
        if num_keys > len(self.count):
            self.count = self.counts(max(num_keys, 2 * len(self.count), 64)).copy()
            self._restart()

    def _restart(self) -> None:
        self.start = np.cumsum(self.count) - self.count


def ragged_index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Element indices of rows (offset, length), concatenated: [o0, o0+1, .., o0+l0-1, o1, ..]."""
    starts = np.cumsum(lengths) - lengths
    return np.repeat(offsets - starts, lengths) + np.arange(int(lengths.sum()))


_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that spreads every input bit over the output."""
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


def row_hashes(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of integers (e.g. completion token ids), rows given back to back.

    `mix(len + sum_j (v_j + 1) * m_j)` modulo 2^64, with a fixed odd multiplier `m_j` per position: equal
    rows always hash equal; distinct rows collide rarely enough that an exact comparison on equal hashes
    stays cheap. Deterministic across processes, so it never needs to be saved.

    Args:
        values: `[sum(lengths)]` integers, row after row.
        lengths: `[n]` elements per row.

    Returns:
        `[n]` uint64 hashes.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    multiplier = _mix64(np.arange(1, int(lengths.max(initial=0)) + 1, dtype=np.uint64)) | np.uint64(1)
    # Each row's multipliers are a prefix of `multiplier`: one slice per row, no per-element index.
    parts = [multiplier[:n] for n in lengths.tolist()]
    terms = np.add(values, 1, dtype=np.uint64, casting="unsafe")  # [sum(lengths)]
    terms *= np.concatenate(parts) if parts else multiplier[:0]
    sums = np.zeros(len(lengths), dtype=np.uint64)
    filled = lengths > 0
    # reduceat wraps modulo 2^64 like the sum (a uint64 cumsum was 8x slower); empty rows would break it.
    sums[filled] = np.add.reduceat(terms, (np.cumsum(lengths) - lengths)[filled]) if filled.any() else 0
    return _mix64(sums + lengths.astype(np.uint64))

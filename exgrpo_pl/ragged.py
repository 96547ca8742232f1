"""RaggedStore: variable-length rows addressed by slot, stored back to back in flat NumPy arrays.

The replay buffer keeps up to 100K trajectories of up to thousands of tokens. One NumPy array per row would
cost an object header per row and a Python-level loop per gather; here every field is one flat array, a row
is (offset, length), and gathering 256 padded rows is a few vectorised ops. Freed rows leave holes that are
compacted away once they exceed 1/16 of the live payload, so the payload's resident memory stays within
1.0625x of it (benchmarks/buffer.py: 1.19x overall after evicting half a 100K buffer, metadata included; at
1/8 it was 1.26x; compaction copies the live rows, which the adds when full pay for).
Plain NumPy, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

GARBAGE_FRACTION = 1 / 16  # compact when freed-but-not-reclaimed elements exceed this share of live ones


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
        index = _ragged_index(self.offset[slots], self.length[slots])
        return {name: values[index] for name, values in self.fields.items()}

    def padded(self, slots: np.ndarray, left: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The rows at `slots` zero-padded to the longest (on the left or right), per field, and the
        `[len(slots), width]` mask of real elements."""
        lengths = self.length[slots]
        width = int(lengths.max(initial=0))
        positions = np.arange(width)
        if left:
            first = self.offset[slots] - (width - lengths)  # arena index of each row's position 0
            padding = positions < (width - lengths)[:, None]
        else:
            first = self.offset[slots]
            padding = positions >= lengths[:, None]
        # Every position reads some element (padding reads a neighbour's, clipped into range inside `take`)
        # and is zeroed afterwards: one gather, no ragged index to build, no temporary for the clipping.
        index = first[:, None] + positions
        out = {}
        for name, values in self.fields.items():
            rows = np.take(values, index, mode="clip") if len(values) else np.zeros(index.shape, values.dtype)
            np.copyto(rows, 0, where=padding)
            out[name] = rows
        return out, ~padding

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


def _ragged_index(offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Element indices of rows (offset, length), concatenated: [o0, o0+1, .., o0+l0-1, o1, ..]."""
    starts = np.cumsum(lengths) - lengths
    return np.repeat(offsets - starts, lengths) + np.arange(int(lengths.sum()))

"""De-duplication of the replay buffer's trajectories: a question keeps one copy of each completion.

Rows are compared by a 64-bit hash of their completion ids (`exgrpo_pl.ragged.row_hashes`), then exactly
where hashes agree. `TrajectoryBuffer.add` (`exgrpo_pl.experience.buffer`) collapses an incoming batch's
duplicates to their last row (`batch_duplicates`), then releases the stored copies of what it is about to
store (`release_stored_copies`), so the newest copy is the one kept. A trajectory without completion ids (the
reference description's dict) is compared by its completion text (`release_same_text`). Plain NumPy, no
Lightning.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from exgrpo_pl.experience.row_layout import Payload
from exgrpo_pl.experience.storage import SlotStorage
from exgrpo_pl.ragged import ragged_index, row_hashes

_HASH_CHUNK = 4096  # slots hashed at a time on load, bounding the temporaries to a few hundred MiB

# Completions to compare, addressed by row: `[rows]` question (dense index) and length, the ids back to back
# and `[rows]` where each row starts in them.
_Rows = namedtuple("_Rows", ["qidx", "lengths", "ids", "starts"])


def batch_duplicates(qidx: np.ndarray, payload: Payload) -> tuple[np.ndarray, np.ndarray]:
    """(`[n]` `row_hashes` of the incoming rows' completion ids, `[n]` bool: False for a row that a later
    row of the batch duplicates) for incoming rows (`[n]` dense question indices, their payload)."""
    incoming = _completions(qidx, payload)
    hashes = row_hashes(incoming.ids, incoming.lengths)
    return hashes, _last_copies(incoming, hashes)


def release_stored_copies(
    storage: SlotStorage, qidx: np.ndarray, payload: Payload, hashes: np.ndarray
) -> None:
    """Release every stored trajectory with the question and completion ids of an incoming row.

    Args:
        storage: the buffer's rows.
        qidx: `[n]` dense question indices of the rows about to be stored.
        payload: their token payload.
        hashes: `[n]` `row_hashes` of their completion ids.
    """
    incoming = _completions(qidx, payload)
    new = np.flatnonzero(incoming.lengths > 0)
    keys = _question_keys(incoming.qidx, hashes)
    stored, _ = storage.index.groups(np.unique(incoming.qidx[new]))
    if not len(stored):  # questions seen for the first time
        return
    stored_keys = _question_keys(storage.cols["qidx"][stored], storage.cols["hash"][stored])
    order = np.argsort(stored_keys)
    stored, stored_keys = stored[order], stored_keys[order]
    low = np.searchsorted(stored_keys, keys[new], side="left")
    high = np.searchsorted(stored_keys, keys[new], side="right")
    pairs = high - low  # almost always 0 or 1
    rows = np.repeat(new, pairs)
    slots = stored[ragged_index(low, pairs)]
    completion = storage.tokens["completion"]
    stored_rows = _Rows(
        storage.cols["qidx"], completion.length, completion.fields["completion_ids"], completion.offset
    )
    same = _same_rows(incoming, rows, stored_rows, slots)
    storage.release(np.unique(slots[same]))


def release_same_text(storage: SlotStorage, qidx: int, text: str) -> None:
    """Release question `qidx`'s stored trajectories without completion ids whose completion is `text`
    (the reference description's dict API, whose completions may be text alone)."""
    slots, _ = storage.index.groups(np.array([qidx]))
    no_ids = slots[storage.tokens["completion"].length[slots] == 0]
    storage.release(no_ids[storage.texts["completions"][no_ids] == text])


def stored_hashes(storage: SlotStorage, slots: np.ndarray) -> np.ndarray:
    """`[n]` `row_hashes` of the stored completion ids at `slots`, a chunk of slots at a time."""
    completion = storage.tokens["completion"]
    parts = [
        row_hashes(completion.rows(chunk)["completion_ids"], completion.length[chunk])
        for chunk in np.split(slots, np.arange(_HASH_CHUNK, len(slots), _HASH_CHUNK))
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _last_copies(incoming: _Rows, hashes: np.ndarray) -> np.ndarray:
    """`[n]` bool: False for a row that a later row of the batch duplicates (same question and ids).

    The last row of each (question, hash) key stands for its key and the rows equal to it go; a row that
    only shares the hash (a collision) stays pending, to be compared with the other such rows.
    """
    keys = _question_keys(incoming.qidx, hashes)
    survive = np.ones(len(keys), dtype=np.bool_)
    pending = np.flatnonzero(incoming.lengths > 0)
    while len(pending) > 1:
        order = np.lexsort((pending, keys[pending]))  # by key, then row: a key's last row ends its run
        pending, sorted_keys = pending[order], keys[pending[order]]
        first = np.append(True, sorted_keys[1:] != sorted_keys[:-1])
        last = np.append(first[1:], True)
        representative = pending[last][np.cumsum(first) - 1]
        others = pending[~last]
        same = _same_rows(incoming, others, incoming, representative[~last])
        survive[others[same]] = False
        pending = others[~same]
    return survive


def _completions(qidx: np.ndarray, payload: Payload) -> _Rows:
    """The completions of incoming rows (`[n]` dense question indices, their payload) to compare."""
    lengths, flat = payload["completion"]
    return _Rows(qidx, lengths, flat["completion_ids"], np.cumsum(lengths) - lengths)


def _same_rows(a: _Rows, i: np.ndarray, b: _Rows, j: np.ndarray) -> np.ndarray:
    """`[pairs]` bool: whether row `i[p]` of `a` and row `j[p]` of `b` are the same question and ids."""
    n = a.lengths[i]
    same = (a.qidx[i] == b.qidx[j]) & (n == b.lengths[j])
    i, j, n = i[same], j[same], n[same]
    differ = a.ids[ragged_index(a.starts[i], n)] != b.ids[ragged_index(b.starts[j], n)]
    mismatches = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(differ)])
    ends = np.cumsum(n)
    same[same] = mismatches[ends] == mismatches[ends - n]
    return same


def _question_keys(qidx: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """uint64 key of (question, completion hash): equal pairs give equal keys; unequal ones rarely do, and
    `_same_rows` tells them apart."""
    return hashes + qidx.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)

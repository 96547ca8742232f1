"""SlotStorage: the replay buffer's stored trajectories, one slot each, and the indices over them.

Per-row metadata lives in preallocated NumPy columns, token payloads (trimmed prompt ids, completion ids,
behaviour log-probs) live back to back in flat arrays (`exgrpo_pl.ragged.RaggedStore`), and a per-question
index of the slots (`exgrpo_pl.ragged.GroupIndex`), kept up to date on every store and release, finds a
question's trajectories without scanning the 100K rows. Freed slots are reused lowest first; when all
`max_size` slots are taken, the oldest trajectories (smallest insertion sequence number) are evicted first.
Each question's dataset columns (`RolloutBatch.columns`) are kept once per question, not per trajectory,
and dropped when its last stored trajectory leaves, so they cost memory per question in the buffer.

`TrajectoryBuffer` (`exgrpo_pl.experience.buffer`) decides what to store and removes; this module keeps the
rows, their eviction order, the buffer's state dict, and turns slots back into a `RolloutBatch`. What a row
holds, and how a batch's rows become token payloads, is `exgrpo_pl.experience.row_layout`. Plain
PyTorch/NumPy, no Lightning.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np
import torch

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience.difficulty import DifficultyBucketer
from exgrpo_pl.experience.row_layout import (
    BATCH_FIELDS,
    COLUMNS,
    DERIVED,
    TEXTS,
    TOKENS,
    WIDE,
    Payload,
    as_numpy,
)
from exgrpo_pl.ragged import GroupIndex, RaggedStore


class SlotStorage:
    """Up to `max_size` stored trajectories in slots, their per-question index and their eviction order.

    Attributes (read and written by `exgrpo_pl.experience.buffer` and its sampling and de-duplication
    modules):
        cols: column name -> `[capacity]` array, see `COLUMNS`; a slot holds a row where "occupied".
        tokens: "prompt" / "completion" -> the `RaggedStore` of that payload, addressed by slot.
        texts: "prompts" / "completions" / "answers" -> `[capacity]` object array.
        columns: question id -> its dataset columns (column name -> value), for the questions with a stored
            trajectory that came with columns.
        size: the number of stored trajectories.
        high_water: slots at or above it were never used.
        index: occupied slots by dense question index, oldest first in each question.
    """

    def __init__(self, max_size: int, bucketer: DifficultyBucketer) -> None:
        self.max_size = max_size
        self.bucketer = bucketer
        self.cols = {name: np.zeros(0, dtype=dtype) for name, dtype in COLUMNS.items()}
        self.tokens = {store: RaggedStore(fields) for store, (_, _, fields) in TOKENS.items()}
        self.texts = {name: np.zeros(0, dtype=object) for name in TEXTS}
        self.columns: dict[int, dict[str, object]] = {}
        self.size = 0
        self.high_water = 0
        self.free: list[int] = []  # heap of freed slots below the high-water mark
        self.next_seq = 0
        self.domain_names: list[str] = []
        self.qidx_version = bucketer.layout_version
        self.index = GroupIndex()
        # (slots, their seq) in insertion order, one entry per add: eviction pops the oldest from the left.
        # An entry whose slot was freed (and maybe reused) since is stale and skipped.
        self.fifo: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self.fifo_length = 0  # entries in fifo, stale ones included

    def reserve(self, n: int) -> None:
        capacity = len(self.cols["seq"])
        if n <= capacity:
            return
        new = max(capacity, 256)
        while new < n:
            new *= 2
        new = min(new, self.max_size)
        for name, col in self.cols.items():
            grown = np.zeros(new, dtype=col.dtype)
            grown[:capacity] = col
            self.cols[name] = grown
        self.cols["qidx"][capacity:] = -1
        for store in self.tokens.values():
            store.reserve_slots(new)
        for name, texts in self.texts.items():
            self.texts[name] = np.append(texts, np.full(new - capacity, None, dtype=object))

    def release(self, slots: np.ndarray) -> None:
        qidx = self.cols["qidx"][slots]
        self.index.remove(slots[qidx >= 0], qidx[qidx >= 0])
        self.cols["occupied"][slots] = False
        self.cols["qidx"][slots] = -1
        for store in self.tokens.values():
            store.release(slots)
        for texts in self.texts.values():
            texts[slots] = None
        for s in slots.tolist():
            heapq.heappush(self.free, s)
        self.size -= len(slots)
        if self.columns and len(slots):  # forget the columns of the questions left without a trajectory
            ids, known = self.cols["question_id"][slots], qidx >= 0
            left = self.index.counts(max(int(qidx.max()), 0) + 1)[np.maximum(qidx, 0)] * known
            if not known.all():  # rows of questions the bucketer does not know are not indexed
                occupied = self.occupied()
                strangers = self.cols["question_id"][occupied[self.cols["qidx"][occupied] < 0]]
                left[~known] = np.isin(ids[~known], strangers)
            for question in np.unique(ids[left == 0]).tolist():
                self.columns.pop(question, None)

    def occupied(self) -> np.ndarray:
        return np.flatnonzero(self.cols["occupied"][: self.high_water])

    def allocate(self, k: int) -> np.ndarray:
        evict = k - (len(self.free) + self.max_size - self.high_water)
        if evict > 0:
            self.release(self.oldest(evict))
        slots = [heapq.heappop(self.free) for _ in range(min(k, len(self.free)))]
        fresh = k - len(slots)
        slots.extend(range(self.high_water, self.high_water + fresh))
        self.high_water += fresh
        self.reserve(self.high_water)
        return np.asarray(slots, dtype=np.int64)

    def oldest(self, n: int) -> np.ndarray:
        """The `n` stored slots with the smallest insertion sequence numbers, taken off the FIFO."""
        taken = []
        while n > 0:
            slots, seqs = self.fifo.popleft()
            self.fifo_length -= len(slots)
            live = np.flatnonzero(self.cols["occupied"][slots] & (self.cols["seq"][slots] == seqs))
            taken.append(slots[live[:n]])
            if len(live) > n:  # the rest of this add's slots stay, still oldest
                self.fifo.appendleft((slots[live[n:]], seqs[live[n:]]))
                self.fifo_length += len(live) - n
            n -= len(taken[-1])
        return np.concatenate(taken)

    def fifo_live(self) -> tuple[np.ndarray, np.ndarray]:
        """The FIFO's live (slot, seq) entries, oldest first."""
        slots = np.concatenate([slots for slots, _ in self.fifo] or [np.zeros(0, dtype=np.int64)])
        seqs = np.concatenate([seqs for _, seqs in self.fifo] or [np.zeros(0, dtype=np.int64)])
        live = self.cols["occupied"][slots] & (self.cols["seq"][slots] == seqs)
        return slots[live], seqs[live]

    def sync_qidx(self) -> None:
        """Re-derive cached dense question indices after the bucketer's layout changed (a state load)."""
        if self.qidx_version == self.bucketer.layout_version:
            return
        occupied = self.occupied()
        self.cols["qidx"][occupied] = self.bucketer.dense_index(self.cols["question_id"][occupied])
        self.qidx_version = self.bucketer.layout_version
        self.rebuild_orders()

    def rebuild_orders(self) -> None:
        """The per-question index and the eviction FIFO from scratch, from the occupied slots' columns."""
        occupied = self.occupied()
        occupied = occupied[np.argsort(self.cols["seq"][occupied], kind="stable")]
        qidx = self.cols["qidx"][occupied]
        self.index = GroupIndex.build(occupied[qidx >= 0], qidx[qidx >= 0])
        self.fifo = deque([(occupied, self.cols["seq"][occupied])] if len(occupied) else [])
        self.fifo_length = len(occupied)

    def cap_per_question(self, qidx: np.ndarray, cap: int) -> None:
        """Evict, for the questions in `qidx`, every trajectory beyond the newest `cap`."""
        questions = np.unique(qidx)
        over = self.index.counts(int(questions[-1]) + 1)[questions] - cap
        slots, _ = self.index.groups(questions[over > 0], first=over[over > 0])  # each one's oldest
        self.release(slots)

    def store(
        self,
        batch: RolloutBatch,
        rows: np.ndarray,
        qidx: np.ndarray,
        hashes: np.ndarray,
        payload: Payload,
        columns: dict[int, dict[str, object]],
    ) -> None:
        """Store `rows` of `batch` (their dense question indices, completion hashes and payload) in slots
        `allocate` gives, evicting the oldest trajectories when full; `columns` (question id -> its columns,
        `RolloutBatch.question_columns`) replace those kept for the stored rows' questions."""
        slots = self.allocate(len(rows))
        cols = self.cols
        for name, field in BATCH_FIELDS.items():
            cols[name][slots] = as_numpy(getattr(batch, field))[rows]
        cols["occupied"][slots] = True
        cols["qidx"][slots] = qidx
        cols["hash"][slots] = hashes
        cols["seq"][slots] = np.arange(self.next_seq, self.next_seq + len(rows))
        self.next_seq += len(rows)
        self.size += len(rows)
        self.index.add(slots, qidx)  # in seq order: oldest first inside each question
        self.fifo.append((slots, cols["seq"][slots]))
        self.fifo_length += len(slots)
        if self.fifo_length > 2 * self.size + 4096:  # removals left many stale entries: drop them
            self.fifo = deque([self.fifo_live()])
            self.fifo_length = len(self.fifo[0][0])
        if batch.domains is None:
            cols["domain"][slots] = -1
        else:
            names = [batch.domains[r] for r in rows.tolist()]
            # None: a row without a domain next to rows with one (a dataset column holds None there).
            self.domain_names += sorted({name for name in names if name is not None} - set(self.domain_names))
            codes = {None: -1, **{name: i for i, name in enumerate(self.domain_names)}}
            cols["domain"][slots] = [codes[name] for name in names]
        for store, (lengths, flat) in payload.items():
            self.tokens[store].write(slots, lengths, flat)
        for name in TEXTS:
            texts = getattr(batch, name)
            self.texts[name][slots] = [texts[r] for r in rows.tolist()] if texts else ""
        for question in np.unique(cols["question_id"][slots]).tolist() if columns else []:
            if question in columns:
                self.columns[question] = columns[question]

    def remove_questions(self, ids: np.ndarray) -> int:
        """Release every stored trajectory of the questions `ids` (`[n]` int64). Returns how many."""
        self.sync_qidx()
        qidx = self.bucketer.dense_index(ids)
        slots, _ = self.index.groups(np.unique(qidx[qidx >= 0]))
        if self.size > len(self.index):  # rows of questions the bucketer does not know are not indexed
            occupied = self.occupied()
            unknown = occupied[self.cols["qidx"][occupied] < 0]
            slots = np.concatenate([slots, unknown[np.isin(self.cols["question_id"][unknown], ids)]])
        self.release(slots)
        return len(slots)

    def row_rates(self, slots: np.ndarray) -> np.ndarray:
        """`[n]` current correctness rate of the question of each slot (NaN for unknown questions)."""
        self.sync_qidx()
        return np.append(self.bucketer.dense_rates(), np.nan)[self.cols["qidx"][slots]]

    def gather(self, slots: np.ndarray, columns: bool = True) -> RolloutBatch:
        """The trajectories at `slots` as a replay batch, advantages against their question's current rate,
        with their questions' dataset columns unless `columns` is False (`slot_columns`)."""
        cols = self.cols
        prompt, prompt_mask = self.tokens["prompt"].padded(slots, left=True, dtypes=WIDE)
        completion, completion_mask = self.tokens["completion"].padded(slots, left=False, dtypes=WIDE)
        rewards = torch.from_numpy(cols["reward"][slots])
        rates = self.row_rates(slots)
        codes = cols["domain"][slots]
        domains = None
        if (codes >= 0).any():
            domains = [self.domain_names[c] if c >= 0 else "default" for c in codes.tolist()]
        return RolloutBatch(
            question_ids=torch.from_numpy(cols["question_id"][slots]),
            prompt_ids=torch.from_numpy(prompt["prompt_ids"]),
            prompt_mask=torch.from_numpy(prompt_mask),
            completion_ids=torch.from_numpy(completion["completion_ids"]),
            completion_mask=torch.from_numpy(completion_mask),
            behaviour_logps=torch.from_numpy(completion["behaviour_logps"]),
            rewards=rewards,
            correct=torch.from_numpy(cols["correct"][slots]),
            entropy=torch.from_numpy(cols["entropy"][slots]),
            advantages=rewards - torch.from_numpy(rates).float(),
            policy_version=torch.from_numpy(cols["policy_version"][slots]),
            replayed=torch.ones(len(slots), dtype=torch.bool),
            group_size=1,
            prompts=self.texts["prompts"][slots].tolist(),
            completions=self.texts["completions"][slots].tolist(),
            answers=self.texts["answers"][slots].tolist(),
            domains=domains,
            columns=self.slot_columns(slots) if columns else None,
        )

    def slot_columns(self, slots: np.ndarray) -> dict[str, list[object]]:
        """The dataset columns of the question of each slot, column name -> `[len(slots)]` values: the union
        of the questions' columns, None where a question lacks one. A question stored without columns (by a
        module whose rollouts carry none, or before they were kept) has its stored answer and domain."""
        entries = list(map(self.columns.get, self.cols["question_id"][slots].tolist()))
        for i in [i for i, entry in enumerate(entries) if entry is None]:
            code = int(self.cols["domain"][slots[i]])
            domain = {"domain": self.domain_names[code]} if code >= 0 else {}
            entries[i] = {"answer": self.texts["answers"][slots[i]], **domain}
        # map() over the rows instead of Python loops: a 256-row sample takes a fraction of the time.
        keys = dict.fromkeys(key for schema in dict.fromkeys(map(tuple, entries)) for key in schema)
        return {key: list(map(dict.get, entries, [key] * len(entries))) for key in keys}

    def state_dict(self) -> dict:
        """The rows oldest first as tensors, flat payloads with lengths, text as lists, and the slot layout
        (the buffer's state dict, less its bucketer)."""
        occupied = self.occupied()
        slots = occupied[np.argsort(self.cols["seq"][occupied], kind="stable")]
        state: dict[str, object] = {
            "slots": torch.from_numpy(slots.copy()),
            **{name: torch.from_numpy(col[slots]) for name, col in self.cols.items() if name not in DERIVED},
        }
        for store, (_, length_key, _) in TOKENS.items():
            state[length_key] = torch.from_numpy(self.tokens[store].length[slots])
            state.update(
                {name: torch.from_numpy(rows) for name, rows in self.tokens[store].rows(slots).items()}
            )
        for name in TEXTS:
            state[name] = self.texts[name][slots].tolist()
        # Per question, in the order of each question's oldest row: the same order however the run got here.
        questions = self.cols["question_id"][slots]
        questions = questions[np.sort(np.unique(questions, return_index=True)[1])].tolist()
        questions = [question for question in questions if question in self.columns]
        state["column_question_ids"] = torch.tensor(questions, dtype=torch.long)
        state["columns"] = [self.columns[question] for question in questions]
        state.update(domain_names=list(self.domain_names), next_seq=self.next_seq, high_water=self.high_water)
        return state

    def load_state_dict(self, state: dict) -> np.ndarray:
        """Restore `state_dict()` output into this empty storage, the bucketer already restored. A smaller
        `max_size` keeps the newest rows that fit (compacted). Returns the slots filled; their "hash" is
        left 0."""
        n = len(state["seq"])
        keep = slice(max(0, n - self.max_size), n)
        if keep.start == 0 and state["high_water"] <= self.max_size:
            slots, self.high_water = state["slots"].numpy().copy(), int(state["high_water"])
        else:
            slots = np.arange(n - keep.start, dtype=np.int64)
            self.high_water = len(slots)
        self.reserve(self.high_water)
        for name in COLUMNS:
            if name not in DERIVED:
                self.cols[name][slots] = state[name][keep].numpy()
        self.cols["occupied"][slots] = True
        self.cols["qidx"][slots] = self.bucketer.dense_index(self.cols["question_id"][slots])
        for store, (_, length_key, fields) in TOKENS.items():
            lengths = state[length_key].numpy()
            first = int(lengths[: keep.start].sum())  # elements of the rows that did not fit
            flat = {name: state[name].numpy()[first:] for name in fields}
            self.tokens[store].write(slots, lengths[keep], flat)
        for name in TEXTS:
            self.texts[name][slots] = state[name][keep]
        self.size = len(slots)
        free = np.ones(self.high_water, dtype=bool)
        free[slots] = False
        self.free = np.flatnonzero(free).tolist()  # ascending, hence already a heap
        self.next_seq = int(state["next_seq"])
        self.domain_names = list(state["domain_names"])
        kept = set(self.cols["question_id"][slots].tolist())
        questions = state.get("column_question_ids", torch.zeros(0, dtype=torch.long)).tolist()
        self.columns = {q: c for q, c in zip(questions, state.get("columns", [])) if q in kept}
        self.rebuild_orders()
        return slots

"""TrajectoryBuffer: columnar storage of past trajectories, eviction, and the replay sampling strategies.

Every stored trajectory is one slot: per-row metadata lives in preallocated NumPy columns, token payloads
(trimmed prompt ids, completion ids, behaviour log-probs) live back to back in flat arrays
(`exgrpo_pl.ragged.RaggedStore`), and a per-question index of the slots (`exgrpo_pl.ragged.GroupIndex`),
kept up to date on every add and eviction, finds a sampled question's trajectories without scanning the
100K rows. The strategy names and their resolution into (question sampling, trajectory selection) live
here. Plain PyTorch/NumPy, no Lightning.
"""

from __future__ import annotations

import heapq
from collections import deque, namedtuple
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch, text_id
from exgrpo_pl.difficulty import (
    DifficultyBucketer,
    check_rate_range,
    gaussian_bucket_draw,
    tier_of,
)
from exgrpo_pl.ragged import GroupIndex, RaggedStore, ragged_index, row_hashes
from exgrpo_pl.validation import check_number

QUESTION_SAMPLING = ("medium_range", "gaussian", "uniform")
TRAJECTORY_SELECTION = ("low_entropy_percentile", "lowest_entropy", "highest_entropy", "random")
STRATEGIES: dict[str, tuple[str, str]] = {
    "medium_difficulty_low_entropy": ("medium_range", "low_entropy_percentile"),  # the seed
    "gaussian_lowest_entropy": ("gaussian", "lowest_entropy"),  # the paper
    "highest_entropy": ("gaussian", "highest_entropy"),  # the paper's ablation
    "uniform": ("uniform", "random"),
}
STRATEGY_ALIASES = {"entropy_guided": "medium_difficulty_low_entropy"}  # the seed's name in SelectiveReplay
KEEP_MODES = ("all", "correct", "correct_of_partial")

EntropyFn = Callable[[RolloutBatch], Tensor]

_COLUMNS = {
    "occupied": np.bool_,
    "question_id": np.int64,
    "qidx": np.int64,  # the bucketer's dense index of the question; -1 for free slots and unknown questions
    "reward": np.float32,
    "correct": np.bool_,
    "entropy": np.float32,
    "policy_version": np.int64,
    "seq": np.int64,  # insertion order, for oldest-first eviction
    "domain": np.int64,  # index into the buffer's domain names; -1 for none
    "hash": np.uint64,  # 64-bit hash of the completion ids, for de-duplication (0 without it)
}
# Token payloads, one RaggedStore per length: store -> (its mask in a RolloutBatch, its length key in a
# state dict, its fields and their stored dtypes).
_TOKENS = {
    "prompt": ("prompt_mask", "prompt_len", {"prompt_ids": np.int32}),
    "completion": (
        "completion_mask",
        "completion_len",
        {"completion_ids": np.int32, "behaviour_logps": np.float32},
    ),
}
_TEXTS = ("prompts", "completions", "answers")
_BATCH_FIELDS = {
    "question_id": "question_ids",
    "reward": "rewards",
    "correct": "correct",
    "entropy": "entropy",
    "policy_version": "policy_version",
}
_DERIVED = ("occupied", "qidx", "hash")  # rebuilt on load, not saved
_SEED_KEYS = ("prompt", "rollout", "reward", "is_correct", "entropy")
_WIDE = {"prompt_ids": np.int64, "completion_ids": np.int64}  # RolloutBatch's dtypes for the stored int32
_HASH_CHUNK = 4096  # slots hashed at a time on load, bounding the temporaries to a few hundred MiB


def resolve_strategy(
    strategy: str, question_sampling: str | None = None, trajectory_selection: str | None = None
) -> tuple[str, str]:
    """The (question_sampling, trajectory_selection) pair a strategy name stands for.

    Args:
        strategy: a key of `STRATEGIES` or `STRATEGY_ALIASES`.
        question_sampling: overrides the strategy's question sampling, one of `QUESTION_SAMPLING`.
        trajectory_selection: overrides the strategy's trajectory selection, one of `TRAJECTORY_SELECTION`.
    """
    name = STRATEGY_ALIASES.get(strategy, strategy)
    if name not in STRATEGIES:
        raise ValueError(
            f"strategy must be one of {sorted([*STRATEGIES, *STRATEGY_ALIASES])}, got {strategy!r}"
        )
    qs, ts = STRATEGIES[name]
    qs = qs if question_sampling is None else question_sampling
    ts = ts if trajectory_selection is None else trajectory_selection
    if qs not in QUESTION_SAMPLING:
        raise ValueError(f"question_sampling must be one of {list(QUESTION_SAMPLING)}, got {qs!r}")
    if ts not in TRAJECTORY_SELECTION:
        raise ValueError(f"trajectory_selection must be one of {list(TRAJECTORY_SELECTION)}, got {ts!r}")
    return qs, ts


class TrajectoryBuffer:
    """Bounded store of past trajectories that replay samples from.

    `add` feeds a batch's outcomes to the bucketer, filters the fresh rows by `keep` and stores them;
    questions the bucketer retires are removed. `add` is what updates the bucketer: whoever shares it with
    the buffer must not also update it with the same rows.

    Eviction: when all `max_size` slots are taken, the oldest trajectories (smallest insertion sequence
    number) are evicted first, and freed slots are reused lowest first.

    De-duplication (`dedup`, on by default): a question keeps at most one copy of each completion (same
    completion token ids). The paper's official code stores a completion only if its text is new for the
    question, i.e. it keeps the first copy; this buffer keeps the newest one instead (the stored copy is
    replaced), because its behaviour log-probs come from the policy closest to the current one, so its
    importance weights are the least stale. Duplicates inside one batch collapse to its last one. Rows are
    compared by a 64-bit hash of their completion ids, then exactly where hashes agree. A trajectory
    without completion ids (the seed's dict without "completion_ids") is compared by its completion text
    instead, with the question's stored trajectories that have no ids either.

    The buffer keeps each trajectory's per-token log-probs under the policy that generated it (the behaviour
    policy) and that policy's version, so importance weights need no copy of the old model: this is what
    the seed's `trajectory_buffer.policy_snapshot` stands for (see `policy_snapshot`).

    Args:
        max_size: maximum number of stored trajectories, >= 1.
        difficulty_tiers: number of tiers `stats()` counts trajectories in, by their question's rate.
        entropy_percentiles: percentiles (0..100, increasing) that split stored entropies into bands;
            `sample(entropy_percentile=...)` must be one of them.
        bucketer: the source of per-question correctness rates; a new `DifficultyBucketer()` when None.
        keep: which fresh trajectories are stored. "all" (the seed): every one; "correct": the correct ones;
            "correct_of_partial" (the paper): the correct ones of questions whose latest group had
            0 < correct < total.
        max_per_question: keep at most this many trajectories of one question, evicting that question's
            oldest first; None (the paper) keeps all. A cap bounds the paper's entropy rescoring, which scores
            every stored trajectory of each sampled question, and drops the stalest trajectories first.
        dedup: keep one copy (the newest) of a completion per question, see above.
    """

    def __init__(
        self,
        max_size: int = 100_000,
        difficulty_tiers: int = 5,
        entropy_percentiles: Sequence[float] = (25, 50, 75),
        bucketer: DifficultyBucketer | None = None,
        keep: str = "all",
        max_per_question: int | None = None,
        dedup: bool = True,
    ) -> None:
        check_number("TrajectoryBuffer", "max_size", max_size, 1, integer=True)
        check_number("TrajectoryBuffer", "difficulty_tiers", difficulty_tiers, 1, integer=True)
        check_number("TrajectoryBuffer", "max_per_question", max_per_question, 1, integer=True, optional=True)
        for p in entropy_percentiles:
            check_number("TrajectoryBuffer", "entropy_percentiles", p, 0, 100)
        percentiles = [float(p) for p in entropy_percentiles]
        if any(a >= b for a, b in zip(percentiles[:-1], percentiles[1:], strict=True)):
            raise ValueError(
                f"entropy_percentiles must be increasing values in [0, 100], got {entropy_percentiles}"
            )
        if keep not in KEEP_MODES:
            raise ValueError(f"keep must be one of {list(KEEP_MODES)}, got {keep!r}")
        self.max_size = int(max_size)
        self.difficulty_tiers = int(difficulty_tiers)
        self.entropy_percentiles = tuple(percentiles)
        self.keep = keep
        self.max_per_question = max_per_question
        self.dedup = bool(dedup)
        self._bucketer = bucketer if bucketer is not None else DifficultyBucketer()
        self.clear()

    @property
    def bucketer(self) -> DifficultyBucketer:
        return self._bucketer

    def __len__(self) -> int:
        return self._size

    def clear(self) -> None:
        """Drop every stored trajectory. The bucketer's statistics and retired set are kept."""
        self._cols = {name: np.zeros(0, dtype=dtype) for name, dtype in _COLUMNS.items()}
        self._tokens = {store: RaggedStore(fields) for store, (_, _, fields) in _TOKENS.items()}
        self._texts = {name: np.zeros(0, dtype=object) for name in _TEXTS}
        self._size = 0
        self._high_water = 0  # slots at or above it were never used
        self._free: list[int] = []  # heap of freed slots below the high-water mark
        self._next_seq = 0
        self._domain_names: list[str] = []
        self._qidx_version = self._bucketer.layout_version
        self._index = GroupIndex()  # occupied slots by dense question index, oldest first in each question
        # (slots, their seq) in insertion order, one entry per add: eviction pops the oldest from the left.
        # An entry whose slot was freed (and maybe reused) since is stale and skipped.
        self._fifo: deque[tuple[np.ndarray, np.ndarray]] = deque()
        self._fifo_length = 0  # entries in _fifo, stale ones included

    def _reserve(self, n: int) -> None:
        capacity = len(self._cols["seq"])
        if n <= capacity:
            return
        new = max(capacity, 256)
        while new < n:
            new *= 2
        new = min(new, self.max_size)
        for name, col in self._cols.items():
            grown = np.zeros(new, dtype=col.dtype)
            grown[:capacity] = col
            self._cols[name] = grown
        self._cols["qidx"][capacity:] = -1
        for store in self._tokens.values():
            store.reserve_slots(new)
        for name, texts in self._texts.items():
            self._texts[name] = np.append(texts, np.full(new - capacity, None, dtype=object))

    def _release(self, slots: np.ndarray) -> None:
        qidx = self._cols["qidx"][slots]
        self._index.remove(slots[qidx >= 0], qidx[qidx >= 0])
        self._cols["occupied"][slots] = False
        self._cols["qidx"][slots] = -1
        for store in self._tokens.values():
            store.release(slots)
        for texts in self._texts.values():
            texts[slots] = None
        for s in slots.tolist():
            heapq.heappush(self._free, s)
        self._size -= len(slots)

    def _occupied(self) -> np.ndarray:
        return np.flatnonzero(self._cols["occupied"][: self._high_water])

    def _allocate(self, k: int) -> np.ndarray:
        evict = k - (len(self._free) + self.max_size - self._high_water)
        if evict > 0:
            self._release(self._oldest(evict))
        slots = [heapq.heappop(self._free) for _ in range(min(k, len(self._free)))]
        fresh = k - len(slots)
        slots.extend(range(self._high_water, self._high_water + fresh))
        self._high_water += fresh
        self._reserve(self._high_water)
        return np.asarray(slots, dtype=np.int64)

    def _oldest(self, n: int) -> np.ndarray:
        """The `n` stored slots with the smallest insertion sequence numbers, taken off the FIFO."""
        taken = []
        while n > 0:
            slots, seqs = self._fifo.popleft()
            self._fifo_length -= len(slots)
            live = np.flatnonzero(self._cols["occupied"][slots] & (self._cols["seq"][slots] == seqs))
            taken.append(slots[live[:n]])
            if len(live) > n:  # the rest of this add's slots stay, still oldest
                self._fifo.appendleft((slots[live[n:]], seqs[live[n:]]))
                self._fifo_length += len(live) - n
            n -= len(taken[-1])
        return np.concatenate(taken)

    def _fifo_live(self) -> tuple[np.ndarray, np.ndarray]:
        """The FIFO's live (slot, seq) entries, oldest first."""
        slots = np.concatenate([slots for slots, _ in self._fifo] or [np.zeros(0, dtype=np.int64)])
        seqs = np.concatenate([seqs for _, seqs in self._fifo] or [np.zeros(0, dtype=np.int64)])
        live = self._cols["occupied"][slots] & (self._cols["seq"][slots] == seqs)
        return slots[live], seqs[live]

    def _sync_qidx(self) -> None:
        """Re-derive cached dense question indices after the bucketer's layout changed (a state load)."""
        if self._qidx_version == self._bucketer.layout_version:
            return
        occupied = self._occupied()
        self._cols["qidx"][occupied] = self._bucketer.dense_index(self._cols["question_id"][occupied])
        self._qidx_version = self._bucketer.layout_version
        self._rebuild_orders()

    def _rebuild_orders(self) -> None:
        """The per-question index and the eviction FIFO from scratch, from the occupied slots' columns."""
        occupied = self._occupied()
        occupied = occupied[np.argsort(self._cols["seq"][occupied], kind="stable")]
        qidx = self._cols["qidx"][occupied]
        self._index = GroupIndex.build(occupied[qidx >= 0], qidx[qidx >= 0])
        self._fifo = deque([(occupied, self._cols["seq"][occupied])] if len(occupied) else [])
        self._fifo_length = len(occupied)

    def add(self, trajectory: RolloutBatch | Mapping) -> int:
        """Record a batch: update the bucketer, drop retired questions, store the fresh rows `keep` admits.

        Which rows are evidence of difficulty: every fresh row, and a replayed row that sits in a group
        (`group_size` rows, contiguous) together with fresh rows of its question, the paper's mix mode: there
        the group's latest count is out of all K rows, as in the paper's official code, so K correct of K
        retires the question. A swap-mode batch (`group_size` 1, every row replayed) updates nothing.
        Replayed rows are never stored again (their stored copies are still there).

        Args:
            trajectory: a `RolloutBatch`, or the seed's dict with keys "prompt", "rollout", "reward",
                "is_correct", "entropy" and optionally "question_id" (default: `text_id` of the prompt),
                "answer", "prompt_ids", "completion_ids", "behaviour_logps", "policy_version", "domain".

        Returns:
            the number of trajectories stored (a fresh copy of a stored duplicate counts; duplicates inside
            the batch count once).
        """
        batch = _batch_from_seed_dict(trajectory) if isinstance(trajectory, Mapping) else trajectory
        if not isinstance(batch, RolloutBatch):
            raise TypeError(
                f"add() takes a RolloutBatch or a trajectory dict, got {type(trajectory).__name__}"
            )
        if batch.question_ids.device.type != "cpu":
            batch = batch.to("cpu")
        replayed = _numpy(batch.replayed)
        counted = _counted_rows(batch, replayed)
        if not counted.any():
            return 0
        self._sync_qidx()
        question_ids, rewards = batch.question_ids, batch.rewards
        domains = batch.domains
        if not counted.all():
            index = torch.from_numpy(np.flatnonzero(counted))
            question_ids, rewards = question_ids[index], rewards[index]
            domains = None if domains is None else [domains[r] for r in index.tolist()]
        retired_now = self._bucketer.update(question_ids, rewards, domains)
        if len(retired_now):
            self.remove_questions(retired_now)
        rows = np.flatnonzero(~replayed)
        qidx = self._bucketer.dense_index(_numpy(batch.question_ids)[rows])
        keep = ~self._bucketer.dense_retired()[qidx]
        if self.keep != "all":
            keep &= _numpy(batch.correct)[rows]
        if self.keep == "correct_of_partial":
            c, t = (x.numpy() for x in self._bucketer.latest_counts(batch.question_ids[rows]))
            keep &= (c > 0) & (c < t)
        rows, qidx = rows[keep], qidx[keep]
        payload = _payload(batch, rows)
        hashes = np.zeros(len(rows), dtype=np.uint64)
        survive = np.ones(len(rows), dtype=np.bool_)
        if self.dedup:
            incoming = _completions(qidx, payload)
            hashes = row_hashes(incoming.ids, incoming.lengths)
            survive = _last_copies(incoming, hashes)
        survive &= np.cumsum(survive[::-1])[::-1] <= self.max_size  # the newest that fit
        rows, qidx, hashes, payload = rows[survive], qidx[survive], hashes[survive], _subset(payload, survive)
        if self.dedup:
            self._release_stored_copies(_completions(qidx, payload), hashes)
            if isinstance(trajectory, Mapping) and len(rows) and not batch.completion_ids.shape[1]:
                self._release_same_text(int(qidx[0]), batch.completions[0])
        if len(rows):
            self._store(batch, rows, qidx, hashes, payload)
            self._cap_per_question(qidx)
        return len(rows)

    def _release_stored_copies(self, incoming: _Rows, hashes: np.ndarray) -> None:
        """Release every stored trajectory with the question and completion ids of an incoming row.

        Args:
            incoming: the rows about to be stored.
            hashes: `[n]` `row_hashes` of their completion ids.
        """
        new = np.flatnonzero(incoming.lengths > 0)
        keys = _question_keys(incoming.qidx, hashes)
        stored, _ = self._index.groups(np.unique(incoming.qidx[new]))
        if not len(stored):  # questions seen for the first time
            return
        stored_keys = _question_keys(self._cols["qidx"][stored], self._cols["hash"][stored])
        order = np.argsort(stored_keys)
        stored, stored_keys = stored[order], stored_keys[order]
        low = np.searchsorted(stored_keys, keys[new], side="left")
        high = np.searchsorted(stored_keys, keys[new], side="right")
        pairs = high - low  # almost always 0 or 1
        rows = np.repeat(new, pairs)
        slots = stored[ragged_index(low, pairs)]
        completion = self._tokens["completion"]
        stored_rows = _Rows(
            self._cols["qidx"], completion.length, completion.fields["completion_ids"], completion.offset
        )
        same = _same_rows(incoming, rows, stored_rows, slots)
        self._release(np.unique(slots[same]))

    def _release_same_text(self, qidx: int, text: str) -> None:
        """Release question `qidx`'s stored trajectories without completion ids whose completion is `text`
        (the seed's dict API, whose completions may be text alone)."""
        slots, _ = self._index.groups(np.array([qidx]))
        no_ids = slots[self._tokens["completion"].length[slots] == 0]
        self._release(no_ids[self._texts["completions"][no_ids] == text])

    def _cap_per_question(self, qidx: np.ndarray) -> None:
        """Evict, for the questions in `qidx`, every trajectory beyond the newest `max_per_question`."""
        if self.max_per_question is None:
            return
        questions = np.unique(qidx)
        over = self._index.counts(int(questions[-1]) + 1)[questions] - self.max_per_question
        slots, _ = self._index.groups(questions[over > 0], first=over[over > 0])  # each one's oldest
        self._release(slots)

    def _store(
        self,
        batch: RolloutBatch,
        rows: np.ndarray,
        qidx: np.ndarray,
        hashes: np.ndarray,
        payload: Payload,
    ) -> None:
        slots = self._allocate(len(rows))
        cols = self._cols
        for name, field in _BATCH_FIELDS.items():
            cols[name][slots] = _numpy(getattr(batch, field))[rows]
        cols["occupied"][slots] = True
        cols["qidx"][slots] = qidx
        cols["hash"][slots] = hashes
        cols["seq"][slots] = np.arange(self._next_seq, self._next_seq + len(rows))
        self._next_seq += len(rows)
        self._size += len(rows)
        self._index.add(slots, qidx)  # in seq order: oldest first inside each question
        self._fifo.append((slots, cols["seq"][slots]))
        self._fifo_length += len(slots)
        if self._fifo_length > 2 * self._size + 4096:  # removals left many stale entries: drop them
            self._fifo = deque([self._fifo_live()])
            self._fifo_length = len(self._fifo[0][0])
        if batch.domains is None:
            cols["domain"][slots] = -1
        else:
            names = [batch.domains[r] for r in rows.tolist()]
            self._domain_names += sorted(set(names).difference(self._domain_names))
            codes = {name: i for i, name in enumerate(self._domain_names)}
            cols["domain"][slots] = [codes[name] for name in names]
        for store, (lengths, flat) in payload.items():
            self._tokens[store].write(slots, lengths, flat)
        for name in _TEXTS:
            texts = getattr(batch, name)
            self._texts[name][slots] = [texts[r] for r in rows.tolist()] if texts else ""

    def remove_questions(self, question_ids: Tensor | Sequence[int]) -> int:
        """Remove every stored trajectory of these questions (used for retired ones). Returns how many."""
        ids = np.asarray(torch.as_tensor(question_ids, dtype=torch.long).reshape(-1).numpy())
        self._sync_qidx()
        qidx = self._bucketer.dense_index(ids)
        slots, _ = self._index.groups(np.unique(qidx[qidx >= 0]))
        if self._size > len(self._index):  # rows of questions the bucketer does not know are not indexed
            occupied = self._occupied()
            unknown = occupied[self._cols["qidx"][occupied] < 0]
            slots = np.concatenate([slots, unknown[np.isin(self._cols["question_id"][unknown], ids)]])
        self._release(slots)
        return len(slots)

    def sample(
        self,
        strategy: str = "medium_difficulty_low_entropy",
        *,
        size: int,
        difficulty_range: tuple[float, float] = (0.3, 0.7),
        entropy_percentile: float = 25,
        generator: torch.Generator | None = None,
        entropy_fn: EntropyFn | None = None,
        gaussian_sigma: float = 0.125,
        question_sampling: str | None = None,
        trajectory_selection: str | None = None,
    ) -> RolloutBatch:
        """Draw up to `size` stored trajectories as a replay batch (`replayed=True`, `group_size=1`).

        A strategy is a (question sampling, trajectory selection) pair, see `STRATEGIES`. Question sampling:
        "medium_range" keeps questions whose current rate lies in `difficulty_range`; "gaussian" (the paper)
        draws a rate bucket with weight `exp(-(rate - 0.5)^2 / (2 sigma^2))`, then a question uniformly
        without replacement inside it, until `size` questions or none are left; "uniform" draws questions
        uniformly without replacement. Trajectory selection: "low_entropy_percentile" (the seed) keeps
        trajectories whose stored entropy is <= the `entropy_percentile`-th percentile of the candidates';
        "lowest_entropy" (the paper) / "highest_entropy" take per question the trajectory with the lowest /
        highest entropy under the current policy, `entropy_fn(candidates)` called at most once, on every
        stored trajectory of the sampled questions that have more than one (stored entropy when None);
        "random" takes one uniformly.
        "medium_range" with "low_entropy_percentile" samples trajectories uniformly (the seed's unit); every
        other pair samples questions, one trajectory each. Retired questions are never sampled; with fewer
        eligible than `size`, fewer rows (possibly none) come back.

        Advantages are `reward - current rate of the question`: a fresh estimate of the group-mean baseline
        under today's policy, where the advantage stored at collection time would be stale. `domains` is None
        unless some sampled row has one ("default" then marks the rows without).

        Args:
            strategy: a name in `STRATEGIES` or `STRATEGY_ALIASES`.
            size: number of rows wanted, >= 0.
            difficulty_range: (low, high) rate range of "medium_range", 0 <= low <= high <= 1.
            entropy_percentile: percentile of "low_entropy_percentile", one of `entropy_percentiles` (checked
                only when that selection is used).
            generator: source of randomness; torch's global generator when None.
            entropy_fn: mean completion-token entropy under the current policy, `RolloutBatch -> [n]`.
            gaussian_sigma: bucket weight width of "gaussian" in rate units, > 0 (1/8: one count at K=8).
            question_sampling: overrides the strategy's question sampling.
            trajectory_selection: overrides the strategy's trajectory selection.
        """
        qs, ts = resolve_strategy(strategy, question_sampling, trajectory_selection)
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        low, high = check_rate_range(difficulty_range, "difficulty_range")
        if ts == "low_entropy_percentile" and entropy_percentile not in self.entropy_percentiles:
            raise ValueError(
                f"entropy_percentile must be one of entropy_percentiles {list(self.entropy_percentiles)}, "
                f"got {entropy_percentile!r}"
            )
        if qs == "gaussian" and not gaussian_sigma > 0:
            raise ValueError(f"gaussian_sigma must be > 0, got {gaussian_sigma!r}")
        rates, eligible = self._replayable()  # refined below
        if qs == "medium_range":
            eligible &= (rates >= low) & (rates <= high)
        threshold = np.inf
        if ts == "low_entropy_percentile":
            # The candidates are a large share of all rows here: one pass over the rows' question column
            # costs less than assembling them from the per-question lists.
            candidates = np.flatnonzero(np.append(eligible, False)[self._cols["qidx"][: self._high_water]])
            entropy = self._cols["entropy"][candidates]
            threshold = _percentile(entropy, entropy_percentile) if len(candidates) else np.inf
            passing = candidates[entropy <= threshold]
            if qs == "medium_range":  # the seed's unit: trajectories, uniformly
                return self._gather(passing[_choose(len(passing), size, generator)])
            eligible[:] = False
            eligible[self._cols["qidx"][passing]] = True  # questions with a trajectory that passed
        if qs == "gaussian":
            by_rate = self._bucketer.dense_by_rate()  # grouped by rate bucket, without a sort
            eligible_ids = by_rate[eligible[by_rate]]
            chosen = eligible_ids[gaussian_bucket_draw(rates[eligible_ids], size, gaussian_sigma, generator)]
        else:
            eligible_ids = np.flatnonzero(eligible)
            chosen = eligible_ids[_choose(len(eligible_ids), size, generator)]
        return self._one_per_question(chosen, ts, threshold, entropy_fn, generator)

    def _replayable(self) -> tuple[np.ndarray, np.ndarray]:
        """(`[num_questions]` rates, `[num_questions]` bool: the question has a stored trajectory, a rate and
        is not retired), in the bucketer's dense order."""
        self._sync_qidx()
        rates = self._bucketer.dense_rates()
        eligible = self._index.counts(len(rates)) > 0
        eligible &= np.isfinite(rates) & ~self._bucketer.dense_retired()
        return rates, eligible

    def num_questions_in(self, difficulty_range: tuple[float, float]) -> int:
        """How many questions replay could draw whose rate lies in `difficulty_range` (inclusive): stored,
        not retired. The supply that `ReplayCallback(bounded_demand=True)` caps a step's replay at."""
        low, high = check_rate_range(difficulty_range, "difficulty_range")
        rates, eligible = self._replayable()
        return int((eligible & (rates >= low) & (rates <= high)).sum())

    def _one_per_question(
        self,
        chosen: np.ndarray,
        selection: str,
        threshold: float,
        entropy_fn: EntropyFn | None,
        generator: torch.Generator | None,
    ) -> RolloutBatch:
        """One trajectory per question in `chosen` (`[k]` dense indices), in that order, by `selection`:
        "random" uniformly, "low_entropy_percentile" uniformly among those with stored entropy <=
        `threshold`, "lowest_entropy" / "highest_entropy" by entropy under `entropy_fn` (stored entropy for
        questions with a single trajectory, or without `entropy_fn`)."""
        slots, counts = self._index.groups(chosen)  # each chosen question's slots, in turn
        first = np.cumsum(counts) - counts
        if selection == "random":
            u = torch.rand(len(chosen), generator=generator, dtype=torch.float64).numpy()
            return self._gather(slots[first + np.minimum((u * counts).astype(np.int64), counts - 1)])
        group = np.repeat(np.arange(len(chosen)), counts)
        if selection == "low_entropy_percentile":
            key = torch.rand(len(slots), generator=generator, dtype=torch.float64).numpy()
            key[self._cols["entropy"][slots] > threshold] = np.inf  # never first where one passed
        else:
            key = self._cols["entropy"][slots].astype(np.float64)
            # A question with one stored trajectory has nothing to choose between: only the others are scored.
            contested = counts[group] > 1
            if entropy_fn is not None and contested.any():
                scores = torch.as_tensor(entropy_fn(self._gather(slots[contested])))
                if scores.shape != (int(contested.sum()),):
                    raise ValueError(
                        f"entropy_fn returned shape {tuple(scores.shape)}, expected ({int(contested.sum())},)"
                    )
                key[contested] = scores.detach().cpu().double().numpy()
            key = -key if selection == "highest_entropy" else key
        order = np.lexsort((key, group))  # by sampling position, then best key first
        return self._gather(slots[order[first]])

    def _gather(self, slots: np.ndarray) -> RolloutBatch:
        cols = self._cols
        prompt, prompt_mask = self._tokens["prompt"].padded(slots, left=True, dtypes=_WIDE)
        completion, completion_mask = self._tokens["completion"].padded(slots, left=False, dtypes=_WIDE)
        rewards = torch.from_numpy(cols["reward"][slots])
        rates = self._row_rates(slots)
        codes = cols["domain"][slots]
        domains = None
        if (codes >= 0).any():
            domains = [self._domain_names[c] if c >= 0 else "default" for c in codes.tolist()]
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
            prompts=self._texts["prompts"][slots].tolist(),
            completions=self._texts["completions"][slots].tolist(),
            answers=self._texts["answers"][slots].tolist(),
            domains=domains,
        )

    @property
    def policy_snapshot(self) -> dict[str, object]:
        """What stands in for the old policy: per stored row (slot order) its "policy_version" (long tensor),
        "question_ids" and "behaviour_logps" (a list of per-token log-prob tensors under the behaviour
        policy). Importance weights `pi_theta / pi_behaviour` need nothing else, so no old model is kept."""
        occupied = self._occupied()
        completion = self._tokens["completion"]
        logps = completion.rows(occupied)["behaviour_logps"]
        return {
            "policy_version": torch.from_numpy(self._cols["policy_version"][occupied]),
            "question_ids": torch.from_numpy(self._cols["question_id"][occupied]),
            "behaviour_logps": list(torch.from_numpy(logps).split(completion.length[occupied].tolist())),
        }

    def entropies(self) -> Tensor:
        """float32 entropy at collection of each stored trajectory (slot order)."""
        return torch.from_numpy(self._cols["entropy"][self._occupied()])

    def rates(self) -> Tensor:
        """float32 current correctness rate of each stored trajectory's question (slot order)."""
        return torch.from_numpy(self._row_rates(self._occupied())).float()

    def _row_rates(self, slots: np.ndarray) -> np.ndarray:
        self._sync_qidx()
        return np.append(self._bucketer.dense_rates(), np.nan)[self._cols["qidx"][slots]]

    def staleness(self, current_version: int) -> Tensor:
        """long `current_version - policy_version` of each stored trajectory (slot order)."""
        return current_version - torch.from_numpy(self._cols["policy_version"][self._occupied()])

    def stats(self, current_version: int | None = None) -> dict[str, float | Tensor]:
        """Buffer statistics for logging.

        Returns "size", "num_questions" (distinct stored), "retired" (bucketer's retired count),
        "tier_counts" (`[difficulty_tiers]` stored trajectories per tier of their question's current rate),
        "entropy_band_edges" (the `entropy_percentiles` of stored entropies) and "entropy_band_counts"
        (`[len(entropy_percentiles) + 1]`, a band including its upper edge), and with `current_version`
        "staleness_mean" / "staleness_max" in policy versions.
        """
        entropy = self.entropies().numpy()
        rates = torch.from_numpy(self._row_rates(self._occupied()))
        edges = np.percentile(entropy, self.entropy_percentiles) if entropy.size else np.zeros(0)
        bands = np.searchsorted(edges, entropy, side="left")
        out: dict[str, float | Tensor] = {
            "size": float(self._size),
            "num_questions": float(len(np.unique(self._cols["question_id"][self._occupied()]))),
            "retired": float(len(self._bucketer.retired)),
            "tier_counts": torch.bincount(
                tier_of(rates[~rates.isnan()], self.difficulty_tiers), minlength=self.difficulty_tiers
            ),
            "entropy_band_edges": torch.as_tensor(edges, dtype=torch.float32).reshape(-1),
            "entropy_band_counts": torch.from_numpy(
                np.bincount(bands, minlength=len(self.entropy_percentiles) + 1)
            ),
        }
        if current_version is not None:
            stale = self.staleness(current_version).double()
            out["staleness_mean"] = float(stale.mean()) if len(stale) else 0.0
            out["staleness_max"] = float(stale.max()) if len(stale) else 0.0
        return out

    def state_dict(self) -> dict:
        """Rows oldest first as tensors, flat payloads with lengths, text as lists, and the bucketer's state;
        loadable with `torch.load(weights_only=True)`."""
        occupied = self._occupied()
        slots = occupied[np.argsort(self._cols["seq"][occupied], kind="stable")]
        state: dict[str, object] = {
            "slots": torch.from_numpy(slots.copy()),
            **{
                name: torch.from_numpy(col[slots]) for name, col in self._cols.items() if name not in _DERIVED
            },
        }
        for store, (_, length_key, _) in _TOKENS.items():
            state[length_key] = torch.from_numpy(self._tokens[store].length[slots])
            state.update(
                {name: torch.from_numpy(rows) for name, rows in self._tokens[store].rows(slots).items()}
            )
        for name in _TEXTS:
            state[name] = self._texts[name][slots].tolist()
        state.update(
            domain_names=list(self._domain_names),
            next_seq=self._next_seq,
            high_water=self._high_water,
            bucketer=self._bucketer.state_dict(),
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output. A smaller `max_size` keeps the newest rows that fit (compacted).
        Rows are restored as saved, duplicates included (a state saved without `dedup`)."""
        self._bucketer.load_state_dict(state["bucketer"])
        self.clear()
        n = len(state["seq"])
        keep = slice(max(0, n - self.max_size), n)
        if keep.start == 0 and state["high_water"] <= self.max_size:
            slots, self._high_water = state["slots"].numpy().copy(), int(state["high_water"])
        else:
            slots = np.arange(n - keep.start, dtype=np.int64)
            self._high_water = len(slots)
        self._reserve(self._high_water)
        for name in _COLUMNS:
            if name not in _DERIVED:
                self._cols[name][slots] = state[name][keep].numpy()
        self._cols["occupied"][slots] = True
        self._cols["qidx"][slots] = self._bucketer.dense_index(self._cols["question_id"][slots])
        for store, (_, length_key, fields) in _TOKENS.items():
            lengths = state[length_key].numpy()
            first = int(lengths[: keep.start].sum())  # elements of the rows that did not fit
            flat = {name: state[name].numpy()[first:] for name in fields}
            self._tokens[store].write(slots, lengths[keep], flat)
        for name in _TEXTS:
            self._texts[name][slots] = state[name][keep]
        self._size = len(slots)
        free = np.ones(self._high_water, dtype=bool)
        free[slots] = False
        self._free = np.flatnonzero(free).tolist()  # ascending, hence already a heap
        self._next_seq = int(state["next_seq"])
        self._domain_names = list(state["domain_names"])
        self._rebuild_orders()
        if self.dedup:
            self._cols["hash"][slots] = self._completion_hashes(slots)

    def _completion_hashes(self, slots: np.ndarray) -> np.ndarray:
        """`[n]` `row_hashes` of the stored completion ids at `slots`, a chunk of slots at a time."""
        completion = self._tokens["completion"]
        parts = [
            row_hashes(completion.rows(chunk)["completion_ids"], completion.length[chunk])
            for chunk in np.split(slots, np.arange(_HASH_CHUNK, len(slots), _HASH_CHUNK))
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def _counted_rows(batch: RolloutBatch, replayed: np.ndarray) -> np.ndarray:
    """`[N]` bool: the rows that are evidence of difficulty, fresh rows and replayed rows that share their
    group (`group_size` contiguous rows) with fresh rows of the same question."""
    counted = ~replayed
    k = batch.group_size
    if k > 1 and replayed.any() and counted.any():
        questions = _numpy(batch.question_ids).reshape(-1, k)  # [G, K]
        fresh = counted.reshape(-1, k)
        with_fresh = ((questions[:, :, None] == questions[:, None, :]) & fresh[:, None, :]).any(2)  # [G, K]
        counted = counted | (replayed & with_fresh.reshape(-1))
    return counted


Payload = dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]  # store -> (lengths [n], field -> flat values)


def _payload(batch: RolloutBatch, rows: np.ndarray) -> Payload:
    """The token payloads of `rows`, trimmed and back to back, in their stored dtypes."""
    payload = {}
    for store, (mask_name, _, fields) in _TOKENS.items():
        mask = _numpy(getattr(batch, mask_name))[rows]  # [n, width]
        payload[store] = (
            mask.sum(1),
            {name: _numpy(getattr(batch, name))[rows][mask].astype(dtype) for name, dtype in fields.items()},
        )
    return payload


def _subset(payload: Payload, keep: np.ndarray) -> Payload:
    """The rows of `payload` where `keep` (`[n]` bool) holds."""
    if keep.all():
        return payload
    out = {}
    for store, (lengths, flat) in payload.items():
        index = ragged_index(np.cumsum(lengths)[keep] - lengths[keep], lengths[keep])
        out[store] = (lengths[keep], {name: values[index] for name, values in flat.items()})
    return out


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


# Completions to compare, addressed by row: `[rows]` question (dense index) and length, the ids back to back
# and `[rows]` where each row starts in them.
_Rows = namedtuple("_Rows", ["qidx", "lengths", "ids", "starts"])


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


def _batch_from_seed_dict(trajectory: Mapping) -> RolloutBatch:
    missing = [key for key in _SEED_KEYS if key not in trajectory]
    if missing:
        raise ValueError(f"trajectory dict is missing keys {missing}; required keys are {list(_SEED_KEYS)}")
    prompt = str(trajectory["prompt"])
    question_id = trajectory.get("question_id", text_id(prompt))
    prompt_ids = torch.as_tensor(trajectory.get("prompt_ids", []), dtype=torch.long).reshape(1, -1)
    completion_ids = torch.as_tensor(trajectory.get("completion_ids", []), dtype=torch.long).reshape(1, -1)
    logps = trajectory.get("behaviour_logps")
    logps = (
        torch.zeros(completion_ids.shape) if logps is None else torch.as_tensor(logps).float().reshape(1, -1)
    )
    return RolloutBatch(
        question_ids=torch.tensor([int(question_id)]),
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones(prompt_ids.shape, dtype=torch.bool),
        completion_ids=completion_ids,
        completion_mask=torch.ones(completion_ids.shape, dtype=torch.bool),
        behaviour_logps=logps,
        rewards=torch.tensor([float(trajectory["reward"])]),
        correct=torch.tensor([bool(trajectory["is_correct"])]),
        entropy=torch.tensor([float(trajectory["entropy"])]),
        advantages=torch.zeros(1),
        policy_version=torch.tensor([int(trajectory.get("policy_version", 0))]),
        replayed=torch.zeros(1, dtype=torch.bool),
        prompts=[prompt],
        completions=[str(trajectory["rollout"])],
        answers=[str(trajectory["answer"])] if "answer" in trajectory else [],
        domains=[str(trajectory["domain"])] if "domain" in trajectory else None,
    )


def _numpy(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).numpy()


def _percentile(values: np.ndarray, q: float) -> float:
    """`np.percentile(values, q)` (linear interpolation) from one partial sort, several times faster."""
    position = q / 100 * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    part = np.partition(values, (low, high))
    return float(part[low]) + (float(part[high]) - float(part[low])) * (position - low)


def _choose(n: int, k: int, generator: torch.Generator | None) -> np.ndarray:
    """`min(k, n)` distinct indices of `range(n)`, uniformly without replacement, in random order."""
    k = min(k, n)
    if 4 * k >= n:
        return torch.randperm(n, generator=generator)[:k].numpy()
    # Few out of many: iid draws with repeats dropped are exact and cost O(k) instead of O(n). For one group
    # this is 3x cheaper than `choose_in_groups`, whose bookkeeping serves many groups.
    picked = np.zeros(0, dtype=np.int64)
    while len(picked) < k:
        draws = torch.randint(n, (2 * (k - len(picked)),), generator=generator).numpy()
        both = np.concatenate([picked, draws])
        _, first = np.unique(both, return_index=True)
        picked = both[np.sort(first)][:k]
    return picked

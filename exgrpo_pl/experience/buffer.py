"""TrajectoryBuffer: the bounded store of past trajectories that replay samples from.

`TrajectoryBuffer` decides what is stored (the bucketer's evidence, `keep`, retirement, the per-question
cap) and composes three parts: `exgrpo_pl.experience.storage` (the slots, their columns and token payloads,
the per-question index, oldest-first eviction, the state dict's rows), `exgrpo_pl.experience.sampling` (the
replay strategies: question sampling and trajectory selection) and `exgrpo_pl.experience.dedup` (one copy of a
completion per question). The strategy names (`STRATEGIES`, ...) are importable from here. Plain
PyTorch/NumPy, no Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience.dedup import (
    batch_duplicates,
    release_same_text,
    release_stored_copies,
    stored_hashes,
)
from exgrpo_pl.experience.difficulty import DifficultyBucketer, check_rate_range, tier_of
from exgrpo_pl.experience.incoming import batch_from_trajectory_dict, counted_rows
from exgrpo_pl.experience.row_layout import as_numpy, batch_payload, payload_subset
from exgrpo_pl.experience.sampling import (
    OFFICIAL_PICK,
    QUESTION_SAMPLING,
    REPLAYED_TRAJECTORIES,
    STRATEGIES,
    STRATEGY_ALIASES,
    TRAJECTORY_SELECTION,
    EntropyFn,
    draw,
    replayable,
    resolve_strategy,
)
from exgrpo_pl.experience.storage import SlotStorage
from exgrpo_pl.validation import check_number

__all__ = ["KEEP_MODES", "OFFICIAL_PICK", "QUESTION_SAMPLING", "REPLAYED_TRAJECTORIES", "STRATEGIES",
           "STRATEGY_ALIASES", "TRAJECTORY_SELECTION", "EntropyFn", "TrajectoryBuffer",
           "resolve_strategy"]  # fmt: skip

KEEP_MODES = ("all", "correct", "correct_of_partial")


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
    without completion ids (the reference description's dict without "completion_ids") is compared by its
    completion text instead, with the question's stored trajectories that have no ids either.

    The buffer keeps each trajectory's per-token log-probs under the policy that generated it (the behaviour
    policy) and that policy's version, so importance weights need no copy of the old model: this is what
    the reference description's `trajectory_buffer.policy_snapshot` stands for (see `policy_snapshot`).

    Dataset columns (`RolloutBatch.columns`) are kept once per question, the newest, until its last stored
    trajectory leaves; sampled rows carry them, so replayed questions are scored as their fresh ones were.
    `add` rejects values a checkpoint cannot hold (`exgrpo_pl.batch.stored_column_value`) before any change.

    Args:
        max_size: maximum number of stored trajectories, >= 1.
        difficulty_tiers: number of tiers `stats()` counts trajectories in, by their question's rate.
        entropy_percentiles: percentiles (0..100, increasing) that split stored entropies into bands;
            `sample(entropy_percentile=...)` must be one of them.
        bucketer: the source of per-question correctness rates; a new `DifficultyBucketer()` when None.
        keep: which fresh trajectories are stored. "all" (the reference description): every one; "correct":
            the correct ones; "correct_of_partial" (the paper): the correct ones of questions whose latest
            group had 0 < correct < total.
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
        return self._storage.size

    def clear(self) -> None:
        """Drop every stored trajectory. The bucketer's statistics and retired set are kept."""
        self._storage = SlotStorage(self.max_size, self._bucketer)

    def add(self, trajectory: RolloutBatch | Mapping) -> int:
        """Record a batch: update the bucketer, drop retired questions, store the fresh rows `keep` admits.

        Which rows are evidence of difficulty: every fresh row, and a replayed row that sits in a group
        (`group_size` rows, contiguous) together with fresh rows of its question, the paper's mix mode: there
        the group's latest count is out of all K rows, as in the paper's official code, so K correct of K
        retires the question. A swap-mode batch (`group_size` 1, every row replayed) updates nothing.
        Replayed rows are never stored again (their stored copies are still there).

        Args:
            trajectory: a `RolloutBatch`, or the reference description's dict with keys "prompt", "rollout",
                "reward", "is_correct", "entropy" and optionally "question_id" (default: `text_id` of the
                prompt), "answer", "prompt_ids", "completion_ids", "behaviour_logps", "policy_version",
                "domain".

        Returns:
            the number of trajectories stored (a fresh copy of a stored duplicate counts; duplicates inside
                the batch count once).

        Raises:
            TypeError: a column value of a fresh row is not one a checkpoint holds (nothing is changed).
        """
        batch = batch_from_trajectory_dict(trajectory) if isinstance(trajectory, Mapping) else trajectory
        if not isinstance(batch, RolloutBatch):
            raise TypeError(
                f"add() takes a RolloutBatch or a trajectory dict, got {type(trajectory).__name__}"
            )
        if batch.question_ids.device.type != "cpu":
            batch = batch.to("cpu")
        replayed = as_numpy(batch.replayed)
        counted = counted_rows(batch, replayed)
        if not counted.any():
            return 0
        columns = batch.question_columns(np.flatnonzero(~replayed).tolist())  # checked before any change
        storage = self._storage
        storage.sync_qidx()
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
        qidx = self._bucketer.dense_index(as_numpy(batch.question_ids)[rows])
        keep = ~self._bucketer.dense_retired()[qidx]
        if self.keep != "all":
            keep &= as_numpy(batch.correct)[rows]
        if self.keep == "correct_of_partial":
            c, t = (x.numpy() for x in self._bucketer.latest_counts(batch.question_ids[rows]))
            keep &= (c > 0) & (c < t)
        rows, qidx = rows[keep], qidx[keep]
        payload = batch_payload(batch, rows)
        hashes = np.zeros(len(rows), dtype=np.uint64)
        survive = np.ones(len(rows), dtype=np.bool_)
        if self.dedup:
            hashes, survive = batch_duplicates(qidx, payload)
        survive &= np.cumsum(survive[::-1])[::-1] <= self.max_size  # the newest that fit
        rows, qidx, hashes = rows[survive], qidx[survive], hashes[survive]
        payload = payload_subset(payload, survive)
        if self.dedup:
            release_stored_copies(storage, qidx, payload, hashes)
            if isinstance(trajectory, Mapping) and len(rows) and not batch.completion_ids.shape[1]:
                release_same_text(storage, int(qidx[0]), batch.completions[0])
        if len(rows):
            storage.store(batch, rows, qidx, hashes, payload, columns)
            if self.max_per_question is not None:
                storage.cap_per_question(qidx, self.max_per_question)
        return len(rows)

    def remove_questions(self, question_ids: Tensor | Sequence[int]) -> int:
        """Remove every stored trajectory of these questions (used for retired ones). Returns how many."""
        ids = np.asarray(torch.as_tensor(question_ids, dtype=torch.long).reshape(-1).numpy())
        return self._storage.remove_questions(ids)

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
        replayed_trajectories: str = "correct",
        questions: Tensor | None = None,
    ) -> RolloutBatch:
        """Draw up to `size` stored trajectories as a replay batch (`replayed=True`, `group_size=1`).

        A strategy is a (question sampling, trajectory selection) pair, see `STRATEGIES`. Question sampling:
        "medium_range" keeps questions whose current rate lies in `difficulty_range`; "gaussian" (the paper)
        draws a rate bucket with weight `exp(-(rate - 0.5)^2 / (2 sigma^2))`, then a question uniformly
        without replacement inside it, until `size` questions or none are left; "uniform" draws questions
        uniformly without replacement. Trajectory selection: "low_entropy_percentile" (the reference
        description) keeps trajectories whose stored entropy is <= the `entropy_percentile`-th percentile of
        the candidates'; "lowest_entropy" (the paper) / "highest_entropy" take per question the trajectory
        with the lowest / highest entropy under the current policy, `entropy_fn(candidates)` called at most
        once, on every stored trajectory of the sampled questions that have more than one (stored entropy when
        None); "random" takes one uniformly; "official_inverted_mask_entropy" the lowest official-code score
        (`exgrpo_pl.step.official_pick`) of them all. Only correct rows are drawn, whatever `keep` stored.
        "medium_range" with "low_entropy_percentile" samples trajectories uniformly (the reference
        description's unit); every other pair samples questions, one trajectory each. Retired questions are
        never sampled; with fewer eligible than `size`, fewer rows (possibly none) come back.

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
            replayed_trajectories: "correct", or the reference description's opt-in
                "any_stored_including_incorrect".
            questions: draw one trajectory per question among these ids only (placement="join"); None: all.
        """
        return draw(
            self._storage, self.entropy_percentiles, strategy, size=size, difficulty_range=difficulty_range,
            entropy_percentile=entropy_percentile, generator=generator, entropy_fn=entropy_fn,
            gaussian_sigma=gaussian_sigma, question_sampling=question_sampling,
            trajectory_selection=trajectory_selection, replayed_trajectories=replayed_trajectories,
            questions=questions,
        )  # fmt: skip

    def question_columns(self, question_id: int) -> dict | None:
        """The dataset columns kept for a question (the buffer's own dict: read it), None when it has none."""
        return self._storage.columns.get(int(question_id))

    def num_questions_in(self, difficulty_range: tuple[float, float], questions: Tensor | None = None) -> int:
        """How many questions replay could draw (stored, not retired, among `questions` where given) whose
        rate lies in `difficulty_range` (inclusive): the supply `ReplayCallback(bounded_demand=True)` caps."""
        low, high = check_rate_range(difficulty_range, "difficulty_range")
        rates, eligible = replayable(self._storage, questions)
        return int((eligible & (rates >= low) & (rates <= high)).sum())

    @property
    def policy_snapshot(self) -> dict[str, object]:
        """What stands in for the old policy: per stored row (slot order) its "policy_version" (long tensor),
        "question_ids" and "behaviour_logps" (a list of per-token log-prob tensors under the behaviour
        policy). Importance weights `pi_theta / pi_behaviour` need nothing else, so no old model is kept."""
        storage = self._storage
        occupied = storage.occupied()
        completion = storage.tokens["completion"]
        logps = completion.rows(occupied)["behaviour_logps"]
        return {
            "policy_version": torch.from_numpy(storage.cols["policy_version"][occupied]),
            "question_ids": torch.from_numpy(storage.cols["question_id"][occupied]),
            "behaviour_logps": list(torch.from_numpy(logps).split(completion.length[occupied].tolist())),
        }

    def entropies(self) -> Tensor:
        """float32 entropy at collection of each stored trajectory (slot order)."""
        return torch.from_numpy(self._storage.cols["entropy"][self._storage.occupied()])

    def rates(self) -> Tensor:
        """float32 current correctness rate of each stored trajectory's question (slot order)."""
        return torch.from_numpy(self._storage.row_rates(self._storage.occupied())).float()

    def staleness(self, current_version: int) -> Tensor:
        """long `current_version - policy_version` of each stored trajectory (slot order)."""
        storage = self._storage
        return current_version - torch.from_numpy(storage.cols["policy_version"][storage.occupied()])

    def stats(self, current_version: int | None = None) -> dict[str, float | Tensor]:
        """Buffer statistics for logging.

        Returns "size", "num_questions" (distinct stored), "retired" (bucketer's retired count),
        "tier_counts" (`[difficulty_tiers]` stored trajectories per tier of their question's current rate),
        "entropy_band_edges" (the `entropy_percentiles` of stored entropies) and "entropy_band_counts"
        (`[len(entropy_percentiles) + 1]`, a band including its upper edge), and with `current_version`
        "staleness_mean" / "staleness_max" in policy versions.
        """
        storage = self._storage
        entropy = self.entropies().numpy()
        rates = torch.from_numpy(storage.row_rates(storage.occupied()))
        edges = np.percentile(entropy, self.entropy_percentiles) if entropy.size else np.zeros(0)
        bands = np.searchsorted(edges, entropy, side="left")
        out: dict[str, float | Tensor] = {
            "size": float(storage.size),
            "num_questions": float(len(np.unique(storage.cols["question_id"][storage.occupied()]))),
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
        """Rows oldest first as tensors, flat payloads with lengths, text as lists, each question's columns
        (a dict each) and the bucketer's state; loadable with `torch.load(weights_only=True)`."""
        state = self._storage.state_dict()
        state["bucketer"] = self._bucketer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output. A smaller `max_size` keeps the newest rows that fit (compacted).
        Rows are restored as saved, duplicates included (a state saved without `dedup`)."""
        self._bucketer.load_state_dict(state["bucketer"])
        self.clear()
        slots = self._storage.load_state_dict(state)
        if self.dedup:
            self._storage.cols["hash"][slots] = stored_hashes(self._storage, slots)

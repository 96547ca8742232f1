"""DifficultyBucketer: windowed per-question correctness rates, difficulty tiers and the retired set.

The bucketer is the single source of "how hard is this question right now" for the buffer and the replay
sampler. It sees every fresh scored trajectory (`update`), keeps a window of each question's most recent
outcomes (the reference description's `window_size`, so difficulty follows the policy as it improves),
remembers the question's latest group (the rollouts of one update call, the paper's buckets) and retires
questions that a whole group solved, for as long as they stay solved. The tier of a rate and the medium
range's check are in `exgrpo_pl.experience.rate_tiers`, the paper's draw of questions by rate bucket in
`exgrpo_pl.experience.bucket_draw`; all are importable from here. Plain PyTorch/NumPy, no Lightning.
"""

from __future__ import annotations

import math
import warnings
from collections import deque

import numpy as np
import torch
from torch import Tensor

from exgrpo_pl.experience.bucket_draw import choose_in_groups, gaussian_bucket_draw
from exgrpo_pl.experience.rate_order import RateOrder
from exgrpo_pl.experience.rate_tiers import centred_range, check_rate_range, tier_of
from exgrpo_pl.validation import check_choice, check_numbers

# tier_of and check_rate_range (exgrpo_pl.experience.rate_tiers), gaussian_bucket_draw and choose_in_groups
# (exgrpo_pl.experience.bucket_draw) are importable from here, where they were defined before.
__all__ = [
    "ALL_WRONG_GROUPS",
    "METRICS",
    "RETIRE_FROM",
    "DifficultyBucketer",
    "check_rate_range",
    "choose_in_groups",
    "gaussian_bucket_draw",
    "tier_of",
]

METRICS = ("correctness_rate",)

# Per-question columns in dense order: name -> (dtype, value of a fresh entry).
_QUESTION_COLUMNS = {
    "qid": (np.int64, 0),
    "rate": (np.float64, np.nan),
    "latest_correct": (np.int64, 0),
    "latest_total": (np.int64, 0),
    "retired": (np.bool_, False),
    "retired_epoch": (np.int64, 0),  # the epoch of the group that retired it
    "domain": (np.int64, -1),  # index into the domain names; -1 for none
}

# What a retired question leaves (`DifficultyBucketer.retire_from`): None = it is never retired.
RETIRE_FROM = ("buffer_and_stream", "buffer")
# What a group with no correct rollout does to its question (`DifficultyBucketer.all_wrong_groups`).
ALL_WRONG_GROUPS = ("count", "keep_last")


class DifficultyBucketer:
    """Per-question correctness over a window of recent trajectories.

    Each question has a window of its last `window_size` outcomes (correct or not) and a latest group, the
    outcomes it got in the most recent `update` call. Its rate is the mean of the window.

    Retirement: a question whose latest group has at least `min_retire_group` rollouts, all correct, is
    retired, because a group with no failures has zero advantage and teaches nothing. A retired question
    leaves the buffer (its trajectories are removed and no new ones are stored, so replay never draws it)
    and, with `retire_from="buffer_and_stream"` (the official code), the fresh question stream too. It stays
    retired only while it stays solved: a later group of it with a failure brings it back. A question out of
    the stream is seen again only if something brings it back to the stream: `readmit_after_epochs`. The
    paper trains one or two passes over 46K questions, where dropping solved questions from the stream costs
    nothing; over many epochs of a small set it drains the pool (the stream ends up holding the hardest
    questions only), which the default, "buffer", avoids: the learning benchmark's small-pool task, 5 seeds,
    is where that was measured (benchmarks/learning.py).

    Questions get a dense index in order of first appearance; the `dense_*` accessors expose per-question
    arrays in that order so the buffer can look rates up for 100K rows with one gather.

    Args:
        metric: how difficulty is measured. Only "correctness_rate" (the fraction of correct rollouts).
        window_size: number of most recent outcomes per question that its rate is computed over, >= 1.
        correct_threshold: a rollout is correct when its reward is strictly greater than this.
        retire_from: what a solved question leaves: "buffer" (the default: it stays in the fresh stream, so
            its next group shows whether it is still solved), "buffer_and_stream" (the official code,
            `configs/exgrpo_paper.yaml`), or None (solved questions are never retired).
        readmit_after_epochs: with "buffer_and_stream", a retired question returns to the fresh stream this
            many epochs after the epoch that retired it (and retires again if its next group is solved);
            None keeps it out for good (the paper).
        min_retire_group: smallest latest group that can retire a question, >= 1. With the default of 2,
            trajectories added one at a time (the reference description's loop) never retire anything.
        all_wrong_groups: what a group of at least `min_retire_group` rollouts with none correct does:
            "count" (the default) records it like any other, so the question's rate drops towards 0 and its
            stored correct trajectories leave the medium range; "keep_last" (the official code, whose bucket
            manager skips such groups) leaves the question's window, rate and latest group as they were, so
            an old success of a question the policy now fails stays a replay candidate in its last bucket (a
            question first seen with such a group stays unknown).
    """

    def __init__(
        self,
        metric: str = "correctness_rate",
        window_size: int = 100,
        correct_threshold: float = 0.5,
        retire_from: str | None = "buffer",
        readmit_after_epochs: int | None = None,
        min_retire_group: int = 2,
        all_wrong_groups: str = "count",
    ) -> None:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {list(METRICS)}, got {metric!r}")
        if retire_from is not None and retire_from not in RETIRE_FROM:
            raise ValueError(
                f"DifficultyBucketer retire_from must be one of {[*RETIRE_FROM, None]}, got {retire_from!r}"
            )
        check_choice("DifficultyBucketer", "all_wrong_groups", all_wrong_groups, ALL_WRONG_GROUPS)
        check_numbers("DifficultyBucketer", locals(), {
            "window_size": {"low": 1, "integer": True}, "correct_threshold": {},
            "min_retire_group": {"low": 1, "integer": True},
            "readmit_after_epochs": {"low": 1, "integer": True, "optional": True},
        })  # fmt: skip
        if readmit_after_epochs is not None and retire_from != "buffer_and_stream":
            raise ValueError(
                f"DifficultyBucketer readmit_after_epochs={readmit_after_epochs} needs "
                f"retire_from='buffer_and_stream' (got {retire_from!r}): only then do questions leave the "
                "stream"
            )
        self.metric = metric
        self.window_size = int(window_size)
        self.correct_threshold = float(correct_threshold)
        self.retire_from = retire_from
        self.readmit_after_epochs = readmit_after_epochs
        self.min_retire_group = int(min_retire_group)
        self.all_wrong_groups = all_wrong_groups
        # The training epoch that `update` stamps on retirements; the trainer's owner keeps it current.
        self.epoch = 0
        self._layout_version = 0
        self._reset()

    def _reset(self) -> None:
        self._index: dict[int, int] = {}
        self._windows: list[deque[bool]] = []
        # Grown by doubling, so adding questions one at a time (the reference description's loop) stays
        # amortised O(1).
        self._cols = {name: np.zeros(0, dtype=dtype) for name, (dtype, _) in _QUESTION_COLUMNS.items()}
        self._domain_names: list[str] = []
        self._domain_codes: dict[str, int] = {}
        self._retired: set[int] = set()
        self._warned_non_binary = False
        self._by_rate = RateOrder()

    def __len__(self) -> int:
        return len(self._index)

    def _col(self, name: str) -> np.ndarray:
        return self._cols[name][: len(self._index)]

    def _add_questions(self, qids: list[int]) -> None:
        start = len(self._index)
        capacity = len(self._cols["qid"])
        if start + len(qids) > capacity:
            new = max(start + len(qids), 2 * capacity, 64)
            for name, (dtype, fill) in _QUESTION_COLUMNS.items():
                grown = np.full(new, fill, dtype=dtype)
                grown[:capacity] = self._cols[name]
                self._cols[name] = grown
        for offset, q in enumerate(qids):
            self._index[q] = start + offset
            self._windows.append(deque(maxlen=self.window_size))
        self._cols["qid"][start : start + len(qids)] = qids

    def _domain_code(self, name: str) -> int:
        if name not in self._domain_codes:
            self._domain_codes[name] = len(self._domain_names)
            self._domain_names.append(name)
        return self._domain_codes[name]

    def update(self, question_ids: Tensor, rewards: Tensor, domains: list[str] | None = None) -> Tensor:
        """Record one batch of fresh scored trajectories.

        Args:
            question_ids: `[N]` long question id of each trajectory.
            rewards: `[N]` float reward of each trajectory; correct means `reward > correct_threshold`.
            domains: optional `N` domain names; each question remembers the last one it was seen with.

        Returns:
            long tensor of the question ids retired by this call (a retired question whose group here has a
                failure is retired no more).
        """
        qids = torch.as_tensor(question_ids).reshape(-1).tolist()
        r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
        if len(qids) != r.numel() or (domains is not None and len(domains) != len(qids)):
            raise ValueError(
                f"update: question_ids ({len(qids)}), rewards ({r.numel()}) and domains "
                f"({None if domains is None else len(domains)}) must have the same length"
            )
        if not self._warned_non_binary and not bool(((r == 0) | (r == 1)).all()):
            warnings.warn(
                "DifficultyBucketer got rewards outside {0, 1}: ExGRPO is designed for discrete correctness "
                "and is not recommended for continuous reward domains; correctness is reward > "
                f"{self.correct_threshold}.",
                UserWarning,
                stacklevel=2,
            )
            self._warned_non_binary = True
        correct = (r > self.correct_threshold).tolist()
        groups: dict[int, list[bool]] = {}
        for q, c in zip(qids, correct, strict=True):
            groups.setdefault(q, []).append(c)
        if self.all_wrong_groups == "keep_last":  # the official code skips a group with no correct rollout
            groups = {q: o for q, o in groups.items() if len(o) < self.min_retire_group or any(o)}
        self._add_questions([q for q in groups if q not in self._index])
        cols = self._cols
        if domains is not None:
            last_domain = dict(zip(qids, domains, strict=True))  # a question keeps the last one seen
            for q, d in last_domain.items():
                if q in groups:  # a skipped all-wrong group ("keep_last") changes nothing of its question
                    cols["domain"][self._index[q]] = self._domain_code(d)
        retired_now = []
        for q, outcomes in groups.items():
            i = self._index[q]
            window = self._windows[i]
            window.extend(outcomes)
            cols["rate"][i] = sum(window) / len(window)
            cols["latest_correct"][i] = sum(outcomes)
            cols["latest_total"][i] = len(outcomes)
            self._by_rate.changed(i)
            if cols["retired"][i] and not all(outcomes):  # no longer solved
                cols["retired"][i] = False
                self._retired.discard(q)
            solved = len(outcomes) >= self.min_retire_group and all(outcomes)
            if self.retire_from is not None and solved:
                cols["retired_epoch"][i] = self.epoch  # solved again: the stream's wait starts over
                if not cols["retired"][i]:
                    cols["retired"][i] = True
                    self._retired.add(q)
                    retired_now.append(q)
        self._by_rate.catch_up_or_resort(len(self._index))
        return torch.tensor(retired_now, dtype=torch.long)

    def dense_index(self, question_ids: np.ndarray | Tensor) -> np.ndarray:
        """Dense index of each question id (-1 for unknown ones), for indexing the `dense_*` arrays."""
        ids = np.asarray(question_ids, dtype=np.int64).reshape(-1)
        uniq, inverse = np.unique(ids, return_inverse=True)
        looked_up = np.array([self._index.get(int(q), -1) for q in uniq], dtype=np.int64)
        return looked_up[inverse]

    def dense_rates(self) -> np.ndarray:
        """`[num_known]` float64 rate of each question, in dense order. Read-only view."""
        view = self._col("rate").view()
        view.flags.writeable = False
        return view

    def dense_retired(self) -> np.ndarray:
        """`[num_known]` bool retired flag of each question, in dense order. Read-only view."""
        view = self._col("retired").view()
        view.flags.writeable = False
        return view

    def dense_by_rate(self) -> np.ndarray:
        """Dense indices of the questions that have a rate, ordered by (rate, dense index). Read-only.

        Equal rates are the paper's buckets, so this is the questions grouped by bucket, kept up to date
        as rates change (`exgrpo_pl.experience.rate_order.RateOrder`) rather than sorted at each call.
        """
        return self._by_rate.ordered(self._col("rate"))

    @property
    def layout_version(self) -> int:
        """Changes whenever dense indices are reassigned (on `load_state_dict`), so cached ones go stale."""
        return self._layout_version

    def rates(self, question_ids: Tensor) -> Tensor:
        """float32 correctness rate of each question over its window; nan for unknown questions."""
        idx = self.dense_index(question_ids)
        out = np.full(idx.shape, np.nan)
        known = idx >= 0
        out[known] = self._cols["rate"][idx[known]]
        return torch.from_numpy(out).float()

    def latest_counts(self, question_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(correct, total) long counts of each question's latest group; (0, 0) for unknown questions."""
        idx = self.dense_index(question_ids)
        known = idx >= 0
        correct = np.zeros(idx.shape, dtype=np.int64)
        total = np.zeros(idx.shape, dtype=np.int64)
        correct[known] = self._cols["latest_correct"][idx[known]]
        total[known] = self._cols["latest_total"][idx[known]]
        return torch.from_numpy(correct), torch.from_numpy(total)

    def known_questions(self) -> Tensor:
        """long ids of every question seen so far, retired ones included, in order of first appearance."""
        return torch.from_numpy(self._col("qid").copy())

    @property
    def retired(self) -> frozenset[int]:
        """Ids of retired questions (a snapshot; retire questions through `update`)."""
        return frozenset(self._retired)

    def out_of_stream(self, epoch: int) -> frozenset[int]:
        """Ids of the retired questions that the fresh question stream leaves out in `epoch`: none unless
        `retire_from` is "buffer_and_stream"; with `readmit_after_epochs`, those retired fewer than that many
        epochs before `epoch`."""
        if self.retire_from != "buffer_and_stream":
            return frozenset()
        retired = self._col("retired")
        if self.readmit_after_epochs is not None:
            retired = retired & (epoch - self._col("retired_epoch") < self.readmit_after_epochs)
        return frozenset(self._col("qid")[retired].tolist())

    def rates_by_domain(self) -> dict[str, Tensor]:
        """float32 rates of known, non-retired questions per domain ("default" for questions without one)."""
        names = self._domain_names + ["default"]
        domain, rate = self._col("domain"), self._col("rate")
        codes = np.where(domain < 0, len(self._domain_names), domain)
        active = ~self._col("retired")
        return {names[c]: torch.from_numpy(rate[(codes == c) & active]).float() for c in np.unique(codes)}

    def histogram(self, num_tiers: int) -> Tensor:
        """`[num_tiers]` long count of known questions (retired ones included) per difficulty tier."""
        tiers = tier_of(torch.from_numpy(self._col("rate")), num_tiers)
        return torch.bincount(tiers, minlength=num_tiers)

    def medium_range(
        self, base: tuple[float, float] = (0.3, 0.7), adaptive: bool = False
    ) -> tuple[float, float]:
        """The rate range that counts as medium difficulty: `base`, or with `adaptive` (the reference
        description's "adjust medium-difficulty bounds based on buffer statistics") `base`'s width centred on
        the median rate of the known, non-retired questions (`exgrpo_pl.experience.rate_tiers.centred_range`).

        Args:
            base: (low, high) with 0 <= low <= high <= 1.
            adaptive: centre the range on the median rate.
        """
        low, high = check_rate_range(base, "base")
        if not adaptive:
            return low, high
        return centred_range(self._col("rate")[~self._col("retired")], low, high)

    def state_dict(self) -> dict:
        """Columnar state (tensors, lists of str, primitives); loads with `torch.load(weights_only=True)`."""
        lengths = [len(w) for w in self._windows]
        outcomes = [c for w in self._windows for c in w]
        return {
            "question_ids": torch.from_numpy(self._col("qid").copy()),
            "window_lengths": torch.tensor(lengths, dtype=torch.long),
            "outcomes": torch.tensor(outcomes, dtype=torch.bool),
            "latest_correct": torch.from_numpy(self._col("latest_correct").copy()),
            "latest_total": torch.from_numpy(self._col("latest_total").copy()),
            "retired": torch.from_numpy(self._col("retired").copy()),
            "retired_epoch": torch.from_numpy(self._col("retired_epoch").copy()),
            "epoch": self.epoch,
            "domain_codes": torch.from_numpy(self._col("domain").copy()),
            "domain_names": list(self._domain_names),
            "warned_non_binary": self._warned_non_binary,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; a window longer than `window_size` keeps its newest outcomes."""
        self._reset()
        self._layout_version += 1
        qids = state["question_ids"].long().tolist()
        self._add_questions(qids)
        outcomes = state["outcomes"].tolist()
        start = 0
        for window, length in zip(self._windows, state["window_lengths"].tolist(), strict=True):
            window.extend(outcomes[start : start + length])  # the deque's maxlen keeps the newest
            start += length
        self._col("rate")[:] = [sum(w) / len(w) if w else math.nan for w in self._windows]
        self._col("latest_correct")[:] = state["latest_correct"].numpy()
        self._col("latest_total")[:] = state["latest_total"].numpy()
        self._col("retired")[:] = state["retired"].numpy()
        if "retired_epoch" in state:  # absent from checkpoints written before re-admission existed
            self._col("retired_epoch")[:] = state["retired_epoch"].numpy()
            self.epoch = int(state["epoch"])
        self._col("domain")[:] = state["domain_codes"].numpy()
        self._domain_names = list(state["domain_names"])
        self._domain_codes = {name: i for i, name in enumerate(self._domain_names)}
        self._retired = {q for q, retired in zip(qids, state["retired"].tolist(), strict=True) if retired}
        self._warned_non_binary = bool(state["warned_non_binary"])

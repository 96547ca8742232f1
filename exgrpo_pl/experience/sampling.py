"""The replay draw: which stored trajectories `TrajectoryBuffer.sample` returns.

A strategy is a (question sampling, trajectory selection) pair: `STRATEGIES` names them, `resolve_strategy`
turns a name (and overrides) into the pair, `draw` samples questions from the bucketer's rates and selects
trajectories from a `SlotStorage` (`exgrpo_pl.experience.storage`). `TrajectoryBuffer.sample`
(`exgrpo_pl.experience.buffer`) documents each strategy. Plain PyTorch/NumPy, no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.experience.difficulty import check_rate_range, gaussian_bucket_draw
from exgrpo_pl.experience.storage import SlotStorage

QUESTION_SAMPLING = ("medium_range", "gaussian", "uniform")
TRAJECTORY_SELECTION = (
    "low_entropy_percentile",
    "lowest_entropy",
    "highest_entropy",
    "random",
    "official_inverted_mask_entropy",  # the official code's score (exgrpo_pl.step.official_pick), to compare
)
STRATEGIES: dict[str, tuple[str, str]] = {
    "medium_difficulty_low_entropy": ("medium_range", "low_entropy_percentile"),  # the reference description
    "gaussian_lowest_entropy": ("gaussian", "lowest_entropy"),  # the paper
    "highest_entropy": ("gaussian", "highest_entropy"),  # the paper's ablation
    "uniform": ("uniform", "random"),
}
OFFICIAL_PICK = "official_inverted_mask_entropy"
# "entropy_guided": the reference description's name in SelectiveReplay.
STRATEGY_ALIASES = {"entropy_guided": "medium_difficulty_low_entropy"}
# Which stored trajectories a draw may return: the correct ones (ExGRPO replays correct solutions), or, by an
# explicit opt-in, every stored one (the reference description's buffer with keep="all" stores wrong answers
# too).
REPLAYED_TRAJECTORIES = ("correct", "any_stored_including_incorrect")

EntropyFn = Callable[[RolloutBatch], Tensor]


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


def draw(
    storage: SlotStorage,
    entropy_percentiles: tuple[float, ...],
    strategy: str,
    *,
    size: int,
    difficulty_range: tuple[float, float],
    entropy_percentile: float,
    generator: torch.Generator | None,
    entropy_fn: EntropyFn | None,
    gaussian_sigma: float,
    question_sampling: str | None,
    trajectory_selection: str | None,
    replayed_trajectories: str = "correct",
    questions: Tensor | None = None,
) -> RolloutBatch:
    """`TrajectoryBuffer.sample` on the buffer's `storage` (and its `entropy_percentiles`), which see."""
    qs, ts = resolve_strategy(strategy, question_sampling, trajectory_selection)
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ValueError(f"size must be an int >= 0, got {size!r}")
    low, high = check_rate_range(difficulty_range, "difficulty_range")
    if ts == "low_entropy_percentile" and entropy_percentile not in entropy_percentiles:
        raise ValueError(
            f"entropy_percentile must be one of entropy_percentiles {list(entropy_percentiles)}, "
            f"got {entropy_percentile!r}"
        )
    if qs == "gaussian" and not gaussian_sigma > 0:
        raise ValueError(f"gaussian_sigma must be > 0, got {gaussian_sigma!r}")
    if replayed_trajectories not in REPLAYED_TRAJECTORIES:
        raise ValueError(
            f"replayed_trajectories must be one of {list(REPLAYED_TRAJECTORIES)}, "
            f"got {replayed_trajectories!r}"
        )
    rates, eligible = replayable(storage, questions)  # refined below
    allowed = None  # [high_water] slots that may be replayed; None: every occupied one
    if replayed_trajectories == "correct":
        allowed = (
            storage.cols["correct"][: storage.high_water] & storage.cols["occupied"][: storage.high_water]
        )
        qidx = storage.cols["qidx"][: storage.high_water]
        has_correct = np.bincount(qidx[allowed & (qidx >= 0)], minlength=len(rates))[: len(rates)] > 0
        eligible &= has_correct
    if qs == "medium_range":
        eligible &= (rates >= low) & (rates <= high)
    threshold = np.inf
    if ts == "low_entropy_percentile":
        # The candidates are a large share of all rows here: one pass over the rows' question column
        # costs less than assembling them from the per-question lists.
        candidates = np.append(eligible, False)[storage.cols["qidx"][: storage.high_water]]
        candidates = np.flatnonzero(candidates if allowed is None else candidates & allowed)
        entropy = storage.cols["entropy"][candidates]
        threshold = _percentile(entropy, entropy_percentile) if len(candidates) else np.inf
        passing = candidates[entropy <= threshold]
        # The reference description's unit: trajectories, drawn uniformly.
        if qs == "medium_range" and questions is None:
            return storage.gather(passing[_choose(len(passing), size, generator)])
        eligible[:] = False
        eligible[storage.cols["qidx"][passing]] = True  # questions with a trajectory that passed
    if qs == "gaussian":
        by_rate = storage.bucketer.dense_by_rate()  # grouped by rate bucket, without a sort
        eligible_ids = by_rate[eligible[by_rate]]
        chosen = eligible_ids[gaussian_bucket_draw(rates[eligible_ids], size, gaussian_sigma, generator)]
    else:
        eligible_ids = np.flatnonzero(eligible)
        chosen = eligible_ids[_choose(len(eligible_ids), size, generator)]
    return _one_per_question(storage, chosen, ts, threshold, entropy_fn, generator, allowed)


def replayable(storage: SlotStorage, questions: Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(`[num_questions]` rates, `[num_questions]` bool: the question has a stored trajectory, a rate and
    is not retired, and is one of `questions` where given), in the bucketer's dense order."""
    storage.sync_qidx()
    rates = storage.bucketer.dense_rates()
    eligible = storage.index.counts(len(rates)) > 0
    eligible &= np.isfinite(rates) & ~storage.bucketer.dense_retired()
    if questions is not None:
        among = np.zeros(len(rates), dtype=np.bool_)
        dense = storage.bucketer.dense_index(questions)
        among[dense[dense >= 0]] = True
        eligible &= among
    return rates, eligible


def _one_per_question(
    storage: SlotStorage,
    chosen: np.ndarray,
    selection: str,
    threshold: float,
    entropy_fn: EntropyFn | None,
    generator: torch.Generator | None,
    allowed: np.ndarray | None = None,
) -> RolloutBatch:
    """One trajectory per question in `chosen` (`[k]` dense indices), in that order, among its slots that
    `allowed` (`[high_water]` bool; None: all) marks, each chosen question having at least one, by
    `selection`:
    "random" uniformly, "low_entropy_percentile" uniformly among those with stored entropy <=
    `threshold`, "lowest_entropy" / "highest_entropy" by entropy under `entropy_fn` (stored entropy for
    questions with a single trajectory, or without `entropy_fn`), "official_inverted_mask_entropy" by the
    lowest of `entropy_fn`'s scores of every candidate in this order (the official code scores them all,
    in chunks that depend on the order; a NaN score is picked first, as its `argmin` does)."""
    slots, counts = storage.index.groups(chosen)  # each chosen question's slots, in turn
    if allowed is not None:
        group = np.repeat(np.arange(len(chosen)), counts)
        keep = allowed[slots]
        slots, counts = slots[keep], np.bincount(group[keep], minlength=len(chosen))
    first = np.cumsum(counts) - counts
    if selection == "random":
        u = torch.rand(len(chosen), generator=generator, dtype=torch.float64).numpy()
        return storage.gather(slots[first + np.minimum((u * counts).astype(np.int64), counts - 1)])
    group = np.repeat(np.arange(len(chosen)), counts)
    if selection == OFFICIAL_PICK:
        if entropy_fn is None:
            raise ValueError(f"trajectory_selection={OFFICIAL_PICK!r} needs entropy_fn: the policy scores")
        key = _scores(entropy_fn, storage.gather(slots, columns=False)).numpy()
        key[np.isnan(key)] = -np.inf
    elif selection == "low_entropy_percentile":
        key = torch.rand(len(slots), generator=generator, dtype=torch.float64).numpy()
        key[storage.cols["entropy"][slots] > threshold] = np.inf  # never first where one passed
    else:
        key = storage.cols["entropy"][slots].astype(np.float64)
        # A question with one stored trajectory has nothing to choose between: only the others are scored.
        contested = counts[group] > 1
        if entropy_fn is not None and contested.any():
            # Rescoring reads the tokens alone: the candidates come without their dataset columns.
            key[contested] = _scores(entropy_fn, storage.gather(slots[contested], columns=False)).numpy()
        key = -key if selection == "highest_entropy" else key
    order = np.lexsort((key, group))  # by sampling position, then best key first
    return storage.gather(slots[order[first]])


def _scores(entropy_fn: EntropyFn, candidates: RolloutBatch) -> Tensor:
    """`entropy_fn(candidates)` as `[n]` float64 on the CPU; the wrong shape is an error naming it."""
    scores = torch.as_tensor(entropy_fn(candidates))
    if scores.shape != (len(candidates),):
        raise ValueError(f"entropy_fn returned shape {tuple(scores.shape)}, expected ({len(candidates)},)")
    return scores.detach().cpu().double()


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

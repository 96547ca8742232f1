"""The paper's draw of questions by rate bucket (`gaussian_bucket_draw`), and the uniform draw without
replacement inside groups it rests on (`choose_in_groups`).

Used by the buffer's replay sampling; importable from `exgrpo_pl.experience.difficulty` too. Plain
PyTorch/NumPy, no Lightning.
"""

from __future__ import annotations

import numpy as np
import torch

from exgrpo_pl.ragged import ragged_index


def gaussian_bucket_draw(
    rates: np.ndarray, size: int, sigma: float, generator: torch.Generator | None
) -> np.ndarray:
    """Indices of `min(size, len(rates))` questions drawn the paper's way: a rate bucket with weight
    `exp(-(rate - 0.5)^2 / (2 sigma^2))` among the non-empty buckets, then a question of it uniformly without
    replacement.

    Vectorised as rejection sampling: draw buckets with replacement and reject draws of exhausted buckets,
    which is exactly drawing from the non-empty ones. Each round that falls short exhausts a bucket, which
    the next round leaves out. Which members a bucket gives is drawn last, only for the buckets drawn
    (`choose_in_groups`), so the cost follows `size`, not the number of questions.

    Args:
        rates: `[n]` float64 finite rates of the eligible questions; equal rates share a bucket. Already
            sorted (as `DifficultyBucketer.dense_by_rate` gives them) saves a sort.
        size: number of questions wanted.
        sigma: width of the bucket weight in rate units, > 0 (the paper: 1 count at K=8, i.e. 0.125).
        generator: source of randomness; torch's global generator when None.

    Returns:
        `[min(size, n)]` int64 indices into `rates`, distinct, in draw order.
    """
    n = len(rates)
    k = min(size, n)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    members = np.arange(n) if bool(np.all(rates[1:] >= rates[:-1])) else np.argsort(rates, kind="stable")
    start = np.flatnonzero(np.diff(rates[members], prepend=-np.inf))  # buckets are runs of equal rates
    capacity = np.diff(np.append(start, n))
    log_weight = -((rates[members[start]] - 0.5) ** 2) / (2 * sigma**2)
    taken = np.zeros(len(start), dtype=np.int64)
    drawn, ranks = [], []  # accepted draws: the bucket, and how many of it were drawn before
    while k > 0:
        live = np.where(taken < capacity, log_weight, -np.inf)
        weight = torch.from_numpy(np.exp(live - live.max()))  # relative weights, immune to underflow
        draws = torch.multinomial(weight, k, replacement=True, generator=generator).numpy()
        rank = taken[draws] + _occurrence(draws)
        accepted = rank < capacity[draws]
        drawn.append(draws[accepted])
        ranks.append(rank[accepted])
        taken += np.bincount(draws[accepted], minlength=len(start))
        k -= int(accepted.sum())
    drawn, ranks = np.concatenate(drawn), np.concatenate(ranks)
    # The j-th draw of bucket b takes the j-th of `taken[b]` members drawn from it in random order.
    offsets = choose_in_groups(capacity, taken, generator)
    first = np.cumsum(taken) - taken
    return members[start[drawn] + offsets[first[drawn] + ranks]]


def choose_in_groups(n: np.ndarray, k: np.ndarray, generator: torch.Generator | None) -> np.ndarray:
    """For each group i, `min(k[i], n[i])` distinct integers of `range(n[i])`, uniformly without replacement,
    in random order; concatenated group after group.

    A group that wants a quarter or more of its members shuffles them all (random keys, one sort); a group
    that wants fewer draws uniformly with replacement and redraws repeats, which is exact and costs O(k)
    rather than O(n).

    Args:
        n: `[g]` int64 group sizes.
        k: `[g]` int64 how many to take from each group.
        generator: source of randomness; torch's global generator when None.

    Returns:
        `[sum(min(k, n))]` int64 offsets inside each group.
    """
    n = np.asarray(n, dtype=np.int64)
    k = np.minimum(np.asarray(k, dtype=np.int64), n)
    out = np.zeros(int(k.sum()), dtype=np.int64)
    out_start = np.cumsum(k) - k
    shuffle = (k > 0) & (4 * k >= n)
    g = np.flatnonzero(shuffle)
    if len(g):
        group = np.repeat(np.arange(len(g)), n[g])
        keys = torch.rand(len(group), generator=generator, dtype=torch.float64).numpy()
        order = np.lexsort((keys, group))  # each group's members in random order, groups in turn
        first = np.cumsum(n[g]) - n[g]
        out[ragged_index(out_start[g], k[g])] = order[ragged_index(first, k[g])] - np.repeat(first, k[g])
    g = np.flatnonzero(~shuffle & (k > 0))
    if len(g):
        size, want = n[g], k[g]
        span = int(size.max())
        keys = np.zeros(0, dtype=np.int64)  # group * span + offset of the draws kept so far, in draw order
        need = want
        while need.any():
            group = np.repeat(np.arange(len(g)), 2 * need)
            u = torch.rand(len(group), generator=generator, dtype=torch.float64).numpy()  # u * size < size
            keys = np.concatenate([keys, group * span + (u * size[group]).astype(np.int64)])
            _, first_seen = np.unique(keys, return_index=True)
            keys = keys[np.sort(first_seen)]  # repeats dropped, draw order kept
            group = keys // span
            keys = keys[_occurrence(group) < want[group]]  # each group's first `want`
            need = want - np.bincount(keys // span, minlength=len(g))
        out[ragged_index(out_start[g], want)] = keys[np.argsort(keys // span, kind="stable")] % span
    return out


def _occurrence(labels: np.ndarray) -> np.ndarray:
    """For each element, how many elements before it carry the same label."""
    order = np.argsort(labels, kind="stable")
    run_start = np.flatnonzero(np.diff(labels[order], prepend=-1))
    occurrence = np.empty(len(labels), dtype=np.int64)
    runs = np.diff(np.append(run_start, len(labels)))
    occurrence[order] = np.arange(len(labels)) - np.repeat(run_start, runs)
    return occurrence

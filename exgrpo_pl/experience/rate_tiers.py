"""Correctness rates as difficulty: the tier a rate falls in, and a valid (low, high) range of rates.

Shared by the bucketer (`exgrpo_pl.experience.difficulty`), the buffer and the replay sampler, and importable
from `exgrpo_pl.experience.difficulty` too. Plain PyTorch, no Lightning.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# A rate c/n that equals a tier edge k/num_tiers can land just below it after rounding (by up to ~6e-8 for
# float32 input); nudging rates up by this keeps it in tier k. A real rate is never that close below an edge
# unless its window holds over a million outcomes.
_TIER_EPS = 1e-6


def tier_of(rates: Tensor, num_tiers: int) -> Tensor:
    """Difficulty tier of each correctness rate: `min(floor(rate * num_tiers), num_tiers - 1)`.

    Tiers split [0, 1] into `num_tiers` equal bins, the last one closed (rate 1.0 is in the top tier).
    Rates outside [0, 1] are clamped into the first or last tier.

    Args:
        rates: float tensor of rates in [0, 1], any shape; must not contain nan.
        num_tiers: number of tiers, >= 1.

    Returns:
        long tensor of the same shape with values in `[0, num_tiers)`.
    """
    if num_tiers < 1:
        raise ValueError(f"num_tiers must be >= 1, got {num_tiers}")
    rates = torch.as_tensor(rates, dtype=torch.float64)
    if torch.isnan(rates).any():
        raise ValueError("tier_of: rates contain nan (unknown questions have no tier)")
    tiers = torch.floor((rates + _TIER_EPS) * num_tiers).long()
    return tiers.clamp_(0, num_tiers - 1)


def check_rate_range(value: tuple[float, float], name: str) -> tuple[float, float]:
    """`value` as a (low, high) pair of floats; ValueError naming `name` unless 0 <= low <= high <= 1."""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair, got {value!r}") from None
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"{name} must satisfy 0 <= low <= high <= 1, got {value!r}")
    return low, high


def centred_range(rates: np.ndarray, low: float, high: float) -> tuple[float, float]:
    """(low, high)'s width centred on the median of the `rates` strictly between 0 and 1, then shifted as
    little as needed to lie inside [0, 1]; (low, high) itself when there are none. The median follows the
    policy: as it improves, "medium" moves up with it. Rates of 0 or 1 are left out because such questions
    carry no GRPO signal."""
    rates = rates[(rates > 0) & (rates < 1)]
    if rates.size == 0:
        return low, high
    half = (high - low) / 2
    centre = min(max(float(np.median(rates)), half), 1.0 - half)
    return centre - half, centre + half

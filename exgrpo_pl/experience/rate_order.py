"""The known questions ordered by correctness rate, kept up to date as rates change: the paper's buckets
(questions of equal rate) side by side, which the replay sampler reads without sorting 100K questions each
step. Plain NumPy."""

from __future__ import annotations

import numpy as np


class RateOrder:
    """Dense indices of the questions that have a rate, ordered by (rate, dense index).

    `changed(i)` notes that question i's rate changed; `ordered(rates)` then re-places only the noted
    questions (one pass over the order instead of a sort), or sorts from scratch when more changed than
    there are questions.
    """

    def __init__(self) -> None:
        self._order: np.ndarray | None = None  # None: sort from scratch at the next `ordered`
        self._changed: list[int] = []  # dense indices whose rate changed since `_order` was brought up

    def changed(self, index: int) -> None:
        self._changed.append(index)

    def catch_up_or_resort(self, num_questions: int) -> None:
        """Drops the noted changes for a sort from scratch when they outnumber the questions."""
        if len(self._changed) > num_questions:
            self._order, self._changed = None, []

    def ordered(self, rates: np.ndarray) -> np.ndarray:
        """The order for `rates` (`[num_questions]`, NaN for a question without a rate). Read-only view."""
        if self._order is None:
            finite = np.flatnonzero(np.isfinite(rates))
            self._order = finite[np.argsort(rates[finite], kind="stable")]
        elif self._changed:
            changed = np.unique(self._changed)
            moved = np.zeros(len(rates), dtype=np.bool_)
            moved[changed] = True
            kept = self._order[~moved[self._order]]
            changed = changed[np.isfinite(rates[changed])]
            changed = changed[np.argsort(rates[changed], kind="stable")]
            # A complex number compares by real part, then imaginary part: (rate, dense index) order.
            at = np.searchsorted(rates[kept] + 1j * kept, rates[changed] + 1j * changed)
            self._order = np.insert(kept, at, changed)
        self._changed = []
        view = self._order.view()
        view.flags.writeable = False
        return view

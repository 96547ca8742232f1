"""RateOrder: the order it keeps up to date is, after any sequence of rate changes, the order a full sort by
(rate, dense index) gives."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pl.experience.rate_order import RateOrder

RATES = st.sampled_from([np.nan, 0.0, 0.25, 0.5, 0.75, 1.0])  # few values: many ties, as buckets have


def sorted_from_scratch(rates: np.ndarray) -> list[int]:
    return sorted(np.flatnonzero(np.isfinite(rates)).tolist(), key=lambda i: (rates[i], i))


@given(st.lists(RATES, min_size=1, max_size=30), st.lists(st.lists(st.tuples(st.integers(0, 29), RATES))))
def test_the_kept_order_is_the_sorted_order_after_every_round_of_changes(initial, rounds):
    rates = np.array(initial, dtype=np.float64)
    order = RateOrder()
    assert order.ordered(rates).tolist() == sorted_from_scratch(rates)
    for changes in rounds:
        for index, rate in changes:
            if index < len(rates):
                rates[index] = rate
                order.changed(index)
        order.catch_up_or_resort(len(rates))
        assert order.ordered(rates).tolist() == sorted_from_scratch(rates)


def test_the_order_is_read_only():
    view = RateOrder().ordered(np.array([0.5, 0.25]))
    assert view.tolist() == [1, 0] and not view.flags.writeable

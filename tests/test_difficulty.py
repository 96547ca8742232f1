"""DifficultyBucketer, tier_of and the Gaussian bucket draw: hand cases and properties."""

import io
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.difficulty import DifficultyBucketer, gaussian_bucket_draw, tier_of


def roundtrip(state):
    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


def update(bucketer, qids, rewards, domains=None):
    return bucketer.update(torch.tensor(qids), torch.tensor(rewards, dtype=torch.float32), domains)


def test_window_keeps_the_last_outcomes():
    b = DifficultyBucketer(window_size=3, retire_solved=False)
    update(b, [1, 1, 2], [1.0, 0.0, 1.0])
    assert b.rates(torch.tensor([1, 2])).tolist() == [0.5, 1.0]
    update(b, [1, 1], [1.0, 1.0])  # window of q1 is now [0, 1, 1]
    assert b.rates(torch.tensor([1])).item() == pytest.approx(2 / 3)
    update(b, [1], [0.0])  # [1, 1, 0]
    assert b.rates(torch.tensor([1])).item() == pytest.approx(2 / 3)
    update(b, [1, 1], [0.0, 0.0])  # [0, 0, 0]
    assert b.rates(torch.tensor([1])).item() == 0.0


def test_latest_group_and_unknown_questions():
    b = DifficultyBucketer(retire_solved=False)
    update(b, [7, 7, 7, 8], [1.0, 0.0, 1.0, 0.0])
    update(b, [7, 7], [0.0, 1.0])
    correct, total = b.latest_counts(torch.tensor([7, 8, 9]))
    assert correct.tolist() == [1, 0, 0] and total.tolist() == [2, 1, 0]
    rates = b.rates(torch.tensor([7, 9]))
    assert rates[0].item() == pytest.approx(3 / 5) and math.isnan(rates[1].item())
    assert b.known_questions().tolist() == [7, 8]


def test_correct_threshold_is_strict():
    b = DifficultyBucketer(correct_threshold=0.5, retire_solved=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        update(b, [1, 1], [0.5, 0.6])
    assert b.rates(torch.tensor([1])).item() == 0.5


def test_retirement():
    b = DifficultyBucketer(min_retire_group=2)
    assert update(b, [1, 1, 1, 1, 2, 2], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]).tolist() == [1]
    assert b.retired == {1}
    assert update(b, [3], [1.0]).tolist() == []  # a group of one proves nothing
    assert update(b, [1, 1], [1.0, 1.0]).tolist() == []  # already retired: not reported twice
    assert update(b, [2, 2], [1.0, 1.0]).tolist() == [2]
    assert b.retired == {1, 2}
    keep = DifficultyBucketer(retire_solved=False)
    assert update(keep, [1, 1], [1.0, 1.0]).tolist() == [] and keep.retired == set()


def test_non_binary_rewards_warn_once():
    b = DifficultyBucketer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        update(b, [1, 2], [0.0, 1.0])
        assert not caught
        update(b, [1, 2], [0.3, 0.9])
        update(b, [1, 2], [0.7, 0.2])
    assert len(caught) == 1 and "discrete correctness" in str(caught[0].message)


def test_rates_by_domain_excludes_retired():
    b = DifficultyBucketer(window_size=10)
    update(
        b,
        [1, 1, 2, 2, 3, 3],
        [1.0, 0.0, 0.0, 0.0, 1.0, 1.0],
        ["math", "math", "code", "code", "math", "math"],
    )
    update(b, [4, 4], [1.0, 0.0])
    by_domain = b.rates_by_domain()
    assert set(by_domain) == {"math", "code", "default"}
    assert by_domain["math"].tolist() == [0.5]  # question 3 was retired
    assert by_domain["code"].tolist() == [0.0]
    assert by_domain["default"].tolist() == [0.5]
    update(b, [2, 2], [1.0, 0.0], ["logic", "logic"])  # the last domain seen wins
    by_domain = b.rates_by_domain()
    assert "code" not in by_domain and by_domain["logic"].tolist() == [0.25]


def test_histogram_counts_known_questions_per_tier():
    b = DifficultyBucketer(retire_solved=False)
    update(b, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 0, 0, 1, 1])
    assert b.histogram(4).tolist() == [1, 0, 1, 1]
    assert b.histogram(1).tolist() == [3]


def test_medium_range_adaptive():
    b = DifficultyBucketer(window_size=10, retire_solved=False)
    assert b.medium_range((0.3, 0.7), adaptive=True) == (0.3, 0.7)  # nothing known yet
    # rates 0.2, 0.4, 0.6 in play; 0.0 and 1.0 carry no signal and stay out of the median
    update(
        b,
        [1] * 5 + [2] * 5 + [3] * 5 + [4] * 2 + [5] * 2,
        [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1],
    )
    assert b.medium_range((0.3, 0.7)) == (0.3, 0.7)
    low, high = b.medium_range((0.3, 0.7), adaptive=True)
    assert (low, high) == pytest.approx((0.2, 0.6))
    update(b, [1] * 10 + [2] * 10 + [3] * 10, [1] * 9 + [0] + [1] * 9 + [0] + [1] * 9 + [0])
    low, high = b.medium_range((0.3, 0.7), adaptive=True)  # median 0.9: shifted to stay inside [0, 1]
    assert (low, high) == pytest.approx((0.6, 1.0))


@given(st.integers(1, 40), st.data())
def test_tier_of_exact_edges(num_tiers, data):
    k = data.draw(st.integers(0, num_tiers))
    expected = min(k, num_tiers - 1)
    assert tier_of(torch.tensor([k / num_tiers], dtype=torch.float64), num_tiers).item() == expected
    assert tier_of(torch.tensor([k / num_tiers], dtype=torch.float32), num_tiers).item() == expected


@given(st.lists(st.floats(0, 1), min_size=1, max_size=50), st.integers(1, 10))
def test_tier_of_is_monotone_and_in_range(rates, num_tiers):
    rates = torch.tensor(sorted(rates), dtype=torch.float64)
    tiers = tier_of(rates, num_tiers)
    assert tiers.dtype == torch.long
    assert ((tiers >= 0) & (tiers < num_tiers)).all()
    assert (tiers.diff() >= 0).all()


def test_tier_of_edges_by_hand():
    assert tier_of(torch.tensor([0.0, 0.19, 0.2, 0.5, 0.99, 1.0]), 5).tolist() == [0, 0, 1, 2, 4, 4]


def test_state_dict_round_trip():
    b = DifficultyBucketer(window_size=4)
    update(b, [1, 1, 2, 2, 3, 3], [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b", "a", "a"])
    with pytest.warns(UserWarning, match="discrete correctness"):
        update(b, [1, 1, 1, 4], [1.0, 1.0, 0.0, 0.5])
    state = roundtrip(b.state_dict())
    c = DifficultyBucketer(window_size=4)
    c.load_state_dict(state)
    ids = torch.tensor([1, 2, 3, 4, 5])
    torch.testing.assert_close(c.rates(ids), b.rates(ids), equal_nan=True)
    assert c.retired == b.retired and c.latest_counts(ids)[1].tolist() == b.latest_counts(ids)[1].tolist()
    assert {k: v.tolist() for k, v in c.rates_by_domain().items()} == {
        k: v.tolist() for k, v in b.rates_by_domain().items()
    }
    assert c.layout_version == b.layout_version + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warned-once flag travelled too
        update(c, [9], [0.5])
    short = DifficultyBucketer(window_size=2)
    short.load_state_dict(state)  # window of q1 [0, 1, 1, 0] keeps its newest two outcomes
    assert short.rates(torch.tensor([1])).item() == 0.5


def test_validation_errors():
    with pytest.raises(ValueError, match="correctness_rate"):
        DifficultyBucketer(metric="accuracy")
    with pytest.raises(ValueError, match="window_size"):
        DifficultyBucketer(window_size=0)
    with pytest.raises(ValueError, match="min_retire_group"):
        DifficultyBucketer(min_retire_group=0)
    with pytest.raises(ValueError, match="num_tiers"):
        tier_of(torch.tensor([0.5]), 0)
    with pytest.raises(ValueError, match="base"):
        DifficultyBucketer().medium_range((0.8, 0.2))
    with pytest.raises(ValueError, match="same length"):
        DifficultyBucketer().update(torch.tensor([1, 2]), torch.tensor([1.0]))


def test_gaussian_bucket_probabilities():
    """Single draws pick a bucket with probability exp(-(r - 0.5)^2 / (2 s^2)), normalised over buckets."""
    rates = np.array([1, 2, 3, 4, 4, 5, 6, 7]) / 8  # two questions share the 0.5 bucket
    buckets = np.unique(rates)
    weight = np.exp(-((buckets - 0.5) ** 2) / (2 * 0.125**2))
    expected = weight / weight.sum()
    g = torch.Generator().manual_seed(0)
    draws = np.array([gaussian_bucket_draw(rates, 1, 0.125, g)[0] for _ in range(6000)])
    freq = np.array([np.mean(rates[draws] == b) for b in buckets])
    np.testing.assert_allclose(freq, expected, atol=0.02)
    # inside the shared bucket the two questions are equally likely
    assert abs(np.mean(draws == 3) - np.mean(draws == 4)) < 0.04


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 8), max_size=40), st.integers(0, 50), st.floats(0.01, 1.0))
def test_gaussian_bucket_draw_is_without_replacement(counts, size, sigma):
    rates = np.array(counts, dtype=np.float64) / 8
    picked = gaussian_bucket_draw(rates, size, sigma, torch.Generator().manual_seed(1))
    assert len(picked) == min(size, len(rates))
    assert len(set(picked.tolist())) == len(picked)
    assert all(0 <= i < len(rates) for i in picked.tolist())

"""DifficultyBucketer, tier_of, the Gaussian bucket draw and choose_in_groups: hand cases and properties."""

import io
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.experience.difficulty import (
    DifficultyBucketer,
    choose_in_groups,
    gaussian_bucket_draw,
    tier_of,
)


def roundtrip(state):
    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return torch.load(f, weights_only=True)


def update(bucketer, qids, rewards, domains=None):
    return bucketer.update(torch.tensor(qids), torch.tensor(rewards, dtype=torch.float32), domains)


def test_window_keeps_the_last_outcomes():
    b = DifficultyBucketer(window_size=3, retire_from=None)
    update(b, [1, 1, 2], [1.0, 0.0, 1.0])
    assert b.rates(torch.tensor([1, 2])).tolist() == [0.5, 1.0]
    update(b, [1, 1], [1.0, 1.0])  # window of q1 is now [0, 1, 1]
    assert b.rates(torch.tensor([1])).item() == pytest.approx(2 / 3)
    update(b, [1], [0.0])  # [1, 1, 0]
    assert b.rates(torch.tensor([1])).item() == pytest.approx(2 / 3)
    update(b, [1, 1], [0.0, 0.0])  # [0, 0, 0]
    assert b.rates(torch.tensor([1])).item() == 0.0


def test_latest_group_and_unknown_questions():
    b = DifficultyBucketer(retire_from=None)
    update(b, [7, 7, 7, 8], [1.0, 0.0, 1.0, 0.0])
    update(b, [7, 7], [0.0, 1.0])
    correct, total = b.latest_counts(torch.tensor([7, 8, 9]))
    assert correct.tolist() == [1, 0, 0] and total.tolist() == [2, 1, 0]
    rates = b.rates(torch.tensor([7, 9]))
    assert rates[0].item() == pytest.approx(3 / 5) and math.isnan(rates[1].item())
    assert b.known_questions().tolist() == [7, 8]


def test_correct_threshold_is_strict():
    b = DifficultyBucketer(correct_threshold=0.5, retire_from=None)
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
    keep = DifficultyBucketer(retire_from=None)
    assert update(keep, [1, 1], [1.0, 1.0]).tolist() == [] and keep.retired == set()


def test_a_retired_question_with_a_failure_is_retired_no_more():
    b = DifficultyBucketer(retire_from="buffer")
    update(b, [1, 1], [1.0, 1.0])
    assert b.retired == {1}
    assert update(b, [1, 1], [1.0, 0.0]).tolist() == [] and b.retired == set()
    assert update(b, [1, 1], [1.0, 1.0]).tolist() == [1]  # solved again: retired again, reported again


def test_out_of_stream_follows_retire_from():
    for retire_from, expected in (("buffer_and_stream", {1}), ("buffer", set()), (None, set())):
        b = DifficultyBucketer(retire_from=retire_from)
        update(b, [1, 1, 2, 2], [1.0, 1.0, 1.0, 0.0])
        assert b.out_of_stream(epoch=5) == expected, retire_from
        assert b.retired == (set() if retire_from is None else {1})  # the buffer drops it either way


def test_readmit_after_epochs_counts_from_the_latest_solved_group():
    b = DifficultyBucketer(retire_from="buffer_and_stream", readmit_after_epochs=2)
    b.epoch = 3
    update(b, [1, 1], [1.0, 1.0])
    assert [b.out_of_stream(e) for e in (3, 4, 5, 6)] == [{1}, {1}, set(), set()]
    b.epoch = 5  # back in the stream at epoch 5 and solved again: out until epoch 7
    update(b, [1, 1], [1.0, 1.0])
    assert [b.out_of_stream(e) for e in (6, 7)] == [{1}, set()]
    restored = DifficultyBucketer(retire_from="buffer_and_stream", readmit_after_epochs=2)
    restored.load_state_dict(b.state_dict())
    assert restored.epoch == 5 and restored.out_of_stream(6) == {1} and restored.out_of_stream(7) == set()


def test_retirement_options_are_checked():
    with pytest.raises(ValueError, match="retire_from"):
        DifficultyBucketer(retire_from="stream")
    with pytest.raises(ValueError, match="readmit_after_epochs"):
        DifficultyBucketer(readmit_after_epochs=0)
    with pytest.raises(ValueError, match="readmit_after_epochs=2 needs retire_from='buffer_and_stream'"):
        DifficultyBucketer(retire_from="buffer", readmit_after_epochs=2)


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
    b = DifficultyBucketer(retire_from=None)
    update(b, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 0, 0, 1, 1])
    assert b.histogram(4).tolist() == [1, 0, 1, 1]
    assert b.histogram(1).tolist() == [3]


def test_medium_range_adaptive():
    b = DifficultyBucketer(window_size=10, retire_from=None)
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


@settings(max_examples=50)
@given(st.lists(st.integers(0, 8), max_size=40), st.integers(0, 50), st.floats(0.01, 1.0))
def test_gaussian_bucket_draw_is_without_replacement(counts, size, sigma):
    rates = np.array(counts, dtype=np.float64) / 8
    picked = gaussian_bucket_draw(rates, size, sigma, torch.Generator().manual_seed(1))
    assert len(picked) == min(size, len(rates))
    assert len(set(picked.tolist())) == len(picked)
    assert all(0 <= i < len(rates) for i in picked.tolist())


def test_gaussian_bucket_draw_is_uniform_inside_a_large_bucket():
    """A bucket of 40 questions gives each with probability 1/40 (the draws with repeats rejected path)."""
    rates = np.array([0.5] * 40 + [0.25] * 3)[::-1].copy()  # unsorted input is sorted first
    g = torch.Generator().manual_seed(0)
    draws = np.concatenate([gaussian_bucket_draw(rates, 2, 0.125, g) for _ in range(4000)])
    counts = np.bincount(draws, minlength=43)
    weight = np.exp(-((np.array([0.25, 0.5]) - 0.5) ** 2) / (2 * 0.125**2))
    p_half = weight[1] / weight.sum()
    assert counts[3:].sum() / len(draws) == pytest.approx(p_half, abs=0.02)  # neither bucket runs out
    np.testing.assert_allclose(counts[3:] / counts[3:].sum(), 1 / 40, atol=0.006)


def test_choose_in_groups_by_hand():
    picked = choose_in_groups(np.array([3, 1, 100, 5]), np.array([3, 2, 2, 0]), torch.Generator())
    assert len(picked) == 3 + 1 + 2
    assert sorted(picked[:3].tolist()) == [0, 1, 2] and picked[3] == 0
    assert len(set(picked[4:].tolist())) == 2 and all(0 <= v < 100 for v in picked[4:])
    assert choose_in_groups(np.zeros(0, np.int64), np.zeros(0, np.int64), None).shape == (0,)


def test_choose_in_groups_is_uniform_over_ordered_picks():
    """Both paths: a group shuffled whole (2 of 3) and one drawn with repeats rejected (2 of 12)."""
    g = torch.Generator().manual_seed(0)
    small, large = {}, {}
    for _ in range(6000):
        a, b, c, d = choose_in_groups(np.array([3, 12]), np.array([2, 2]), g).tolist()
        small[(a, b)] = small.get((a, b), 0) + 1
        large[c] = large.get(c, 0) + 1
        assert c != d
    assert len(small) == 6 and all(abs(v / 6000 - 1 / 6) < 0.02 for v in small.values())
    assert len(large) == 12 and all(abs(v / 6000 - 1 / 12) < 0.015 for v in large.values())


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 70)), max_size=8), st.integers(0, 5))
def test_choose_in_groups_gives_distinct_offsets(groups, seed):
    n = np.array([a for a, _ in groups], dtype=np.int64)
    k = np.array([b for _, b in groups], dtype=np.int64)
    picked = choose_in_groups(n, k, torch.Generator().manual_seed(seed))
    want = np.minimum(n, k)
    assert len(picked) == want.sum()
    for part, size in zip(np.split(picked, np.cumsum(want)[:-1]), n.tolist()):
        assert len(set(part.tolist())) == len(part) and all(0 <= v < size for v in part.tolist())


def test_dense_by_rate_by_hand():
    b = DifficultyBucketer(retire_from=None)
    update(b, [10, 10, 11, 12, 12], [1.0, 0.0, 1.0, 0.0, 0.0])  # rates .5, 1, 0
    assert b.dense_by_rate().tolist() == [2, 0, 1]
    update(b, [13, 12, 12], [1.0, 1.0, 1.0])  # q12: 2/4 = .5 ties q10 (dense 0 < 2); q13 rate 1 after q11
    assert b.dense_by_rate().tolist() == [0, 2, 1, 3]
    assert not b.dense_by_rate().flags.writeable


@settings(max_examples=40)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 12), st.booleans()), min_size=1, max_size=8), max_size=12),
    st.integers(0, 11),
)
def test_dense_by_rate_matches_a_sort(updates, reload_after):
    """Kept up to date incrementally, the order equals a stable sort of the rates, also across a load."""
    b = DifficultyBucketer(window_size=3, retire_from=None)
    for step, rows in enumerate(updates):
        update(b, [q for q, _ in rows], [float(c) for _, c in rows])
        if step % 3 == 0 or step == len(updates) - 1:
            rates = b.dense_rates()
            assert b.dense_by_rate().tolist() == np.argsort(rates, kind="stable").tolist()
        if step == reload_after:
            b.dense_by_rate()
            fresh = DifficultyBucketer(window_size=3, retire_from=None)
            fresh.load_state_dict(b.state_dict())
            b = fresh
    assert b.dense_by_rate().tolist() == np.argsort(b.dense_rates(), kind="stable").tolist()


def test_all_wrong_groups_keep_last_leaves_the_question_in_its_last_bucket():
    """The paper's code skips a group with no correct rollout: the question keeps its last bucket, window and
    latest group; a question first seen that way stays unknown. "count" records it like any other group."""
    for rule, rate, latest in (("count", 0.0, (0, 8)), ("keep_last", 3 / 8, (3, 8))):
        b = DifficultyBucketer(window_size=8, retire_from=None, all_wrong_groups=rule)
        update(b, [1] * 8, [1.0] * 3 + [0.0] * 5)
        update(b, [1] * 8 + [2] * 8, [0.0] * 16, domains=["a"] * 16)
        assert b.rates(torch.tensor([1])).item() == pytest.approx(rate)
        correct, total = b.latest_counts(torch.tensor([1]))
        assert (correct.item(), total.item()) == latest
        assert (2 in b.known_questions().tolist()) == (rule == "count")
    keep = DifficultyBucketer(retire_from=None, all_wrong_groups="keep_last")
    update(keep, [3], [0.0])  # a group smaller than min_retire_group (the seed's loop) always counts
    assert keep.rates(torch.tensor([3])).item() == 0.0
    with pytest.raises(ValueError, match="all_wrong_groups"):
        DifficultyBucketer(all_wrong_groups="skip")


def test_keep_last_keeps_an_old_success_a_likely_draw():
    """A question at 3/8, then 0/8, beside ten at 4/8, four questions drawn by the paper's Gaussian over
    buckets: under "keep_last" it is drawn most of the time (its 3/8 bucket holds it alone), under "count"
    almost never (rate 0, four sigmas from the mean)."""
    drawn = {}
    for rule in ("count", "keep_last"):
        b = DifficultyBucketer(window_size=8, retire_from=None, all_wrong_groups=rule)
        update(b, [0] * 8, [1.0] * 3 + [0.0] * 5)
        for q in range(1, 11):
            update(b, [q] * 8, [1.0] * 4 + [0.0] * 4)
        update(b, [0] * 8, [0.0] * 8)
        rates = b.dense_rates()
        g = torch.Generator().manual_seed(0)
        drawn[rule] = np.mean([0 in gaussian_bucket_draw(rates, 4, 0.125, g).tolist() for _ in range(2000)])
    assert drawn["count"] < 0.01 and drawn["keep_last"] > 0.75

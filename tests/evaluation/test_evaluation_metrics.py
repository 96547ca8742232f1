"""The paper's metrics: exact small cases and properties against their definitions."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pl.evaluation import ProblemSamples, avg_at_k, majority_correct, pass_at_k, summarize


def test_pass_at_k_small_cases():
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 3, 2) == 1.0  # two draws cannot both miss with one wrong sample


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_binomial_ratio(case):
    n, c, k = case
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)
    if k < n:
        assert pass_at_k(n, c, k) <= pass_at_k(n, c, k + 1) + 1e-12


@pytest.mark.parametrize("n, c, k", [(3, 1, 4), (3, 4, 1), (3, 1, 0)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_majority_vote_ties_go_to_the_first_answer_and_unanswered_samples_abstain():
    assert majority_correct(["4", "5", "5", None], [True, False, False, False]) == 0.0
    assert majority_correct(["4", "5", "5", "4"], [True, False, False, True]) == 1.0  # tie: "4" came first
    assert majority_correct([None, None, "7"], [False, False, True]) == 1.0
    assert majority_correct([None, None], [False, False]) is None


def test_a_set_summary_weighs_each_problem_the_same():
    problems = [
        ProblemSamples(
            [True, True, False, False], [3, 5, 4, 4], [False, False, False, True], ["1", "1", "2", None]
        ),
        ProblemSamples([False, False, False, False], [6, 6, 6, 6], [True] * 4, ["3", "3", "4", "4"]),
    ]
    figures = summarize(problems, k=4)
    assert figures["avg@4"] == pytest.approx(0.25)  # (2/4 + 0/4) / 2
    assert figures["pass@4"] == pytest.approx(0.5)
    assert figures["pass@1"] == pytest.approx(0.25)
    assert figures["maj@4"] == pytest.approx(0.5)
    assert figures["mean_length"] == pytest.approx(40 / 8) and figures["clipped_ratio"] == pytest.approx(
        5 / 8
    )
    assert figures["problems"] == 2 and figures["samples"] == 8
    assert "greedy_pass@1" not in figures  # no greedy sample was taken
    with_greedy = [ProblemSamples([True], [2], [False], greedy_correct=False)]
    assert summarize(with_greedy)["greedy_pass@1"] == 0.0 and "maj@1" not in summarize(with_greedy)


def test_k_above_the_fewest_samples_is_an_error():
    with pytest.raises(ValueError, match="k=3: every problem needs at least k samples"):
        summarize([ProblemSamples([True, False], [1, 1], [False, False])], k=3)
    assert avg_at_k([True, False, True]) == pytest.approx(2 / 3)

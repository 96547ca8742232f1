"""Tests for the arithmetic, exact-match and format rewards, and for every shipped reward given TRL's
conversational completions."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pl.rewards import (
    ArithmeticReward,
    ExactMatchReward,
    FormatReward,
    MathVerifyReward,
    completion_text,
    compute_rewards,
)


def score(reward, completion, answer):
    return reward(prompts=["p"], completions=[completion], answer=[answer])[0]


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("82", "82", 1.0),
        (" 82", "82", 1.0),
        ("\n\t82", "82", 1.0),
        ("82=", "82", 1.0),
        ("82 is it", "82", 1.0),
        ("82.5", "82", 1.0),  # leading integer, then a non-digit
        ("082", "82", 1.0),
        ("-8", "-8", 1.0),
        ("-8", "8", 0.0),
        ("8", "-8", 0.0),
        ("-0", "0", 1.0),
        ("0", 0, 1.0),
        ("82", 82, 1.0),
        ("820", "82", 0.0),
        ("8", "82", 0.0),
        ("8 2", "82", 0.0),
        ("+82", "82", 0.0),
        ("- 8", "-8", 0.0),
        ("--8", "-8", 0.0),
        ("x82", "82", 0.0),
        ("", "82", 0.0),
        ("   ", "0", 0.0),
        ("=", "0", 0.0),
        ("٨٢", "82", 0.0),  # Arabic-Indic digits are not the task's digits
        ("9" * 10_000, "9" * 10_000, 1.0),  # beyond int()'s 4300-digit limit
        ("9" * 10_000, "1", 0.0),
        ("\x00\xff garbage", "3", 0.0),
    ],
)
def test_arithmetic_cases(completion, answer, expected):
    assert score(ArithmeticReward(), completion, answer) == expected


def test_arithmetic_rejects_non_integer_answer():
    with pytest.raises(ValueError, match="row 1 is not an integer"):
        ArithmeticReward()(["a", "b"], ["1", "2"], answer=["1", "two"])


@given(st.integers(-(10**30), 10**30), st.text(alphabet="=+-abc ", max_size=5))
def test_arithmetic_accepts_any_integer_followed_by_a_non_digit(value, tail):
    assert score(ArithmeticReward(), f"{value}{tail}", str(value)) == 1.0


@given(st.text(max_size=30), st.integers(-1000, 1000))
def test_arithmetic_never_raises_on_completions(completion, answer):
    assert score(ArithmeticReward(), completion, str(answer)) in (0.0, 1.0)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("Paris", "paris", 1.0),
        ("  New   York\n", "new york", 1.0),
        ("STRASSE", "straße", 1.0),  # casefold, not lower
        ("Paris!", "Paris", 0.0),
        ("", "x", 0.0),
        ("42", 42, 1.0),
    ],
)
def test_exact_match_normalized(completion, answer, expected):
    assert score(ExactMatchReward(), completion, answer) == expected


def test_exact_match_raw():
    reward = ExactMatchReward(normalize=False)
    assert score(reward, "Paris", "Paris") == 1.0
    assert score(reward, "Paris ", "Paris") == 0.0
    assert score(reward, "paris", "Paris") == 0.0


def test_format_fullmatch_spans_lines():
    reward = FormatReward(r"<think>.*</think>\s*<answer>.*</answer>")
    good = "<think>a\nb</think>\n<answer>4</answer>"
    assert reward(["p", "p"], [good, good + " trailing"]) == [1.0, 0.0]


def test_format_invalid_pattern_names_it():
    with pytest.raises(ValueError, match=r"invalid regular expression '\(unclosed'"):
        FormatReward("(unclosed")


# Conversational completions (TRL's, for a message-list prompt): one assistant message


def said(text):
    return [{"role": "assistant", "content": text}]


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 80+2?"}]


def test_completion_text_of_text_and_of_conversations():
    assert completion_text("82") == "82"
    assert completion_text(said("82")) == "82"
    assert completion_text(MESSAGES) == "What is 80+2?"  # a conversational prompt: its last message
    for bad in ([], [{"role": "assistant"}], {"content": "82"}, None):
        with pytest.raises(TypeError, match="expected a completion text or a list of messages"):
            completion_text(bad)


@pytest.mark.parametrize(
    "reward, completions, answers, expected",
    [
        (ArithmeticReward(), ["82", "81"], ["82", "82"], [1.0, 0.0]),
        (ExactMatchReward(), [" Paris", "Rome"], ["paris", "paris"], [1.0, 0.0]),
        (FormatReward(r"[0-9]+"), ["82", "x"], [None, None], [1.0, 0.0]),
    ],
)
def test_the_shipped_rewards_score_a_conversational_completion_as_its_text(
    reward, completions, answers, expected
):
    prompts = [MESSAGES] * len(completions)
    assert reward(prompts, [said(c) for c in completions], answer=answers) == expected
    assert reward(["p"] * len(completions), completions, answer=answers) == expected


def test_math_verify_scores_a_conversational_completion_as_its_text():
    pytest.importorskip("math_verify")
    reward = MathVerifyReward(timeout_seconds=None)  # checks in this process: no worker to start
    completions = [said(r"so \boxed{\frac{1}{2}}"), said(r"\boxed{3}")]
    assert reward([MESSAGES] * 2, completions, answer=["0.5", "4"]) == [1.0, 0.0]


def test_a_bad_score_for_a_conversational_completion_names_its_text():
    def nan_reward(prompts, completions, **columns):
        return [float("nan")] * len(completions)

    with pytest.raises(ValueError, match=r"returned nan for row 0 \(completion '82'\)"):
        compute_rewards([nan_reward], None, [MESSAGES], [said("82")], {})


def test_the_shipped_rewards_extract_the_answer_majority_voting_compares():
    from exgrpo_pl.rewards import ArithmeticReward, ExactMatchReward, MathVerifyReward, ReasoningReward

    assert ArithmeticReward().extract_answer(" 082 and more") == "82"
    assert ArithmeticReward().extract_answer("x") is None
    assert ReasoningReward().extract_answer("12+3=15;15+4=19") == "19"
    assert ReasoningReward().extract_answer("no steps") is None
    assert ExactMatchReward().extract_answer("  Paris \n") == "paris"
    assert (
        MathVerifyReward(timeout_seconds=None).extract_answer(r"so \boxed{ \frac{1}{2} }.") == r"\frac{1}{2}"
    )
    assert MathVerifyReward(timeout_seconds=None).extract_answer("no box") is None

"""Tests for MultipleChoiceReward: the paper's boxed-label rule, the answer-phrase fallback, conversational
completions, and its answers for majority voting."""

import pytest

from exgrpo_pl.rewards import compute_rewards
from exgrpo_pl.rewards.multiple_choice import MultipleChoiceReward, option_label


def score(reward, completion, answer):
    return reward(prompts=["p"], completions=[completion], answer=[answer])[0]


@pytest.mark.parametrize(
    ("completion", "chosen"),
    [
        ("so the answer is \\boxed{C}", "C"),
        ("\\boxed{c}", "C"),  # the paper's grader compares case-blind
        ("\\boxed{(B)}", "B"),
        ("\\boxed{ \\text{(D)} }", "D"),
        ("$\\boxed{\\textbf{A}}$", "A"),
        ("\\boxed {2}", "2"),  # ARC's questions numbered 1-4
        ("first \\boxed{A}, then on reflection \\boxed{B}", "B"),  # the last box
        ("\\boxed{C) Planetary days will become shorter.}", None),  # more than a label
        ("\\boxed{A, C}", None),
        ("\\boxed{42}", None),
        ("\\boxed{AB}", None),
        ("\\boxed{C", None),  # truncated: the last box never closes
        ("ANSWER: C", None),  # the paper reads boxes only
        ("", None),
    ],
)
def test_the_paper_rule_reads_the_label_of_the_last_box(completion, chosen):
    assert MultipleChoiceReward().extract_answer(completion) == chosen


@pytest.mark.parametrize(
    ("completion", "chosen"),
    [
        ("ANSWER: C", "C"),
        ("Thinking... Answer: (B).", "B"),
        ("So the answer is D", "D"),
        ("**Answer:** A", "A"),
        ("The answer is (C). On second thought the answer is B.", "B"),  # the last phrase
        ("the answer is 3", "3"),
        ("\\boxed{A} and finally ANSWER: B", "A"),  # a boxed label comes first
        ("\\boxed{C) the long option} so ANSWER: C", "C"),  # no label in the box: the phrase
        ("the answer is a prime", None),  # lower-case: a word, not a label
        ("the answer is AB", None),  # not a token of its own
        ("Answer: 42", None),
        ("I do not know", None),
        ("Answer: I think it is B", None),  # the pronoun I is no option label
        ("Answer: A number of them fit, so B.", None),  # nor the article A
        ("Answer: (B) I think", "B"),  # a bracketed label is one whatever follows
        ("The answer is C.\nThat is all.", "C"),  # its sentence ends after it
        ("Answer: D\n", "D"),
        ("Answer: 3.5", None),  # a decimal, not option 3
    ],
)
def test_the_fallback_reads_the_last_answer_phrase(completion, chosen):
    assert MultipleChoiceReward(boxed_only=False).extract_answer(completion) == chosen


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("\\boxed{C}", "C", 1.0),
        ("\\boxed{c}", "C", 1.0),
        ("\\boxed{B}", "C", 0.0),  # a wrong letter
        ("\\boxed{2}", "2", 1.0),
        ("\\boxed{2}", "B", 0.0),
        ("no letter at all", "A", 0.0),
        ("\\boxed{A}", "(a)", 1.0),  # the reference is a label too, normalized alike
    ],
)
def test_scores(completion, answer, expected):
    assert score(MultipleChoiceReward(), completion, answer) == expected


def test_a_conversational_completion_is_scored_on_its_text():
    reward = MultipleChoiceReward()
    right = [{"role": "assistant", "content": "\\boxed{D}"}]
    wrong = [{"role": "assistant", "content": "\\boxed{A}"}]
    prompts = [[{"role": "user", "content": "Which? A) x B) y C) z D) w"}]] * 2
    assert reward(prompts, [right, wrong], answer=["D", "D"]) == [1.0, 0.0]
    assert reward.extract_answer(right) == "D"


def test_no_chosen_letter_scores_zero_and_extracts_none():
    reward = MultipleChoiceReward(boxed_only=False)
    assert reward.extract_answer("I cannot decide between them.") is None
    assert score(reward, "I cannot decide between them.", "A") == 0.0


def test_an_answer_that_is_not_a_label_is_an_error_naming_its_row():
    with pytest.raises(ValueError, match=r"multiple_choice: answer '42' of row 1 is not an option label"):
        MultipleChoiceReward()(["p", "q"], ["\\boxed{A}", "\\boxed{B}"], answer=["A", "42"])


def test_option_label():
    assert [option_label(t) for t in ["C", " [d] ", "$\\mathrm{(e)}$", "10", "C.", ""]] == [
        "C",
        "D",
        "E",
        None,
        None,
        None,
    ]


def test_it_runs_in_process_under_a_time_limit():
    reward = MultipleChoiceReward(name="mc")
    total, per_function = compute_rewards(
        [reward], None, ["p", "q"], ["\\boxed{A}", "\\boxed{B}"], {"answer": ["A", "A"]}, timeout_seconds=5
    )
    assert reward.in_process and total.tolist() == [1.0, 0.0] and list(per_function) == ["mc"]

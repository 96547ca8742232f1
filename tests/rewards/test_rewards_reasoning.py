"""Tests for the derivation verifier: exact cases, errors, conversational prompts and completions, and
properties over random sums and derivations."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pl.data import write_derivation
from exgrpo_pl.rewards import ReasoningReward
from exgrpo_pl.rewards.reasoning import parse_steps, parse_terms


def score(completion, prompt="12+7+30=", answer="49", check_steps=False):
    reward = ReasoningReward(check_steps=check_steps)
    return reward(prompts=[prompt], completions=[completion], answer=[answer])[0]


def sum_prompt(terms):
    return str(terms[0]) + "".join(f"{'+' if t >= 0 else '-'}{abs(t)}" for t in terms[1:]) + "="


@pytest.mark.parametrize(
    ("completion", "prompt", "answer", "result", "proof"),
    [
        ("12+7=19;19+30=49", "12+7+30=", "49", 1.0, 1.0),
        ("7+30=37;37+12=49", "12+7+30=", "49", 1.0, 1.0),
        ("30+12=42;7+42=49", "12+7+30=", 49, 1.0, 1.0),
        (" 12 + 7 = 19 ;\n19+30 = 49 ", "12+7+30=", "49", 1.0, 1.0),
        ("12+7=19;19+30=49;", "12+7+30=", "49", 1.0, 1.0),  # one trailing separator
        ("12+7=19;19+30=049", "12+7+30=", "49", 1.0, 1.0),
        ("12+7=20;20+30=49", "12+7+30=", "49", 1.0, 0.0),  # a wrong step
        ("12+12=24;24+25=49", "12+7+30=", "49", 1.0, 0.0),  # terms not from the prompt
        ("19+30=49", "12+7+30=", "49", 1.0, 0.0),  # skips a step
        ("12+7=19;19+30=49;49+0=49", "12+7+30=", "49", 1.0, 0.0),  # a term the prompt lacks
        ("12+7=19;19+30=48", "12+7+30=", "49", 0.0, 0.0),
        ("12+7=19;19+30=49;;", "12+7+30=", "49", 0.0, 0.0),
        ("12+7=19;19+30=49x", "12+7+30=", "49", 0.0, 0.0),
        ("12+7=19 19+30=49", "12+7+30=", "49", 0.0, 0.0),
        ("49", "12+7+30=", "49", 0.0, 0.0),  # an answer without a derivation
        ("12-7=5;5-30=-25", "12-7-30=", "-25", 1.0, 1.0),
        ("-7-30=-37;-37+12=-25", "12-7-30=", "-25", 1.0, 1.0),
        ("-30+12=-18;-18-7=-25", "12-7-30=", "-25", 1.0, 1.0),
        ("7+30=37;12-37=-25", "12-7-30=", "-25", 1.0, 0.0),  # regroups the signs: not the prompt's terms
        ("12+-7=5;5-30=-25", "12-7-30=", "-25", 0.0, 0.0),
        ("12-7=5;5-30=25", "12-7-30=", "-25", 0.0, 0.0),
        ("12+7=19;30+1=31;19+31=50", "12+7+30+1=", "50", 1.0, 1.0),  # a tree, not a chain
        ("5+5=10;10+5=15", "5+5+5=", "15", 1.0, 1.0),
        ("5+5=10;10+10=20;20-5=15", "5+5+5=", "15", 1.0, 0.0),
        ("3-3=0", "3-3=", "0", 1.0, 1.0),
        ("3-3=-0", "3-3=", "0", 1.0, 1.0),
        ("", "12+7+30=", "49", 0.0, 0.0),
        (";", "12+7+30=", "49", 0.0, 0.0),
        ("=49", "12+7+30=", "49", 0.0, 0.0),
        ("12+7=", "12+7+30=", "49", 0.0, 0.0),
        ("\x00\xff garbage", "12+7+30=", "49", 0.0, 0.0),
        ("٤+٥=٩", "4+5=", "9", 0.0, 0.0),  # Arabic-Indic digits are not the task's digits
        ("9" * 5000 + "+1=1", "1+2=", "1", 0.0, 0.0),  # beyond int()'s 4300-digit limit
    ],
)
def test_cases(completion, prompt, answer, result, proof):
    assert score(completion, prompt, answer) == result
    assert score(completion, prompt, answer, check_steps=True) == proof


def test_parsers():
    assert parse_terms(" 12 - 7 + 30 = ") == [12, -7, 30]
    assert parse_terms("-4+5=") == [-4, 5]
    assert parse_steps("12-7=5;5+30=35") == [(12, -7, 5), (5, 30, 35)]
    assert parse_steps("12-7=5;") == [(12, -7, 5)]
    assert parse_steps("") is None and parse_steps("1+1") is None


@pytest.mark.parametrize("prompt", ["12=", "12+7", "12+7=19", "a+b=", "12*7=", ""])
def test_bad_prompts(prompt):
    with pytest.raises(ValueError, match="is not a sum of integers"):
        parse_terms(prompt)


def test_errors_name_the_row():
    reward = ReasoningReward(check_steps=True)
    with pytest.raises(ValueError, match="answer 'x' of row 1 is not an integer"):
        reward(["1+2=", "1+2="], ["1+2=3", "1+2=3"], answer=["3", "x"])
    with pytest.raises(ValueError, match=r"row 1: prompt 'what is 1\+2' is not a sum"):
        reward(["1+2=", "what is 1+2"], ["1+2=3", "1+2=3"], answer=["3", "3"])
    # Without check_steps the prompt is never read, so any prompt text is fine.
    assert ReasoningReward()(["what is 1+2"], ["1+2=3"], answer=["3"]) == [1.0]


terms_lists = st.lists(st.integers(-999, 999), min_size=2, max_size=6)


@given(terms_lists, st.randoms(use_true_random=False))
def test_every_chain_order_proves_the_sum(terms, rng):
    prompt = sum_prompt(terms)
    derivation = write_derivation(prompt, rng=rng)
    assert score(derivation, prompt, str(sum(terms)), check_steps=True) == 1.0


@given(terms_lists, st.data())
def test_every_grouping_proves_the_sum(terms, data):
    # Any binary tree: combine two values of the pool, in either order, until one is left.
    pool, steps = list(terms), []
    while len(pool) > 1:
        i = data.draw(st.integers(0, len(pool) - 1))
        x = pool.pop(i)
        y = pool.pop(data.draw(st.integers(0, len(pool) - 1)))
        steps.append(f"{x}{'+' if y >= 0 else '-'}{abs(y)}={x + y}")
        pool.append(x + y)
    assert score(";".join(steps), sum_prompt(terms), str(sum(terms)), check_steps=True) == 1.0


@given(terms_lists, st.randoms(use_true_random=False), st.integers(-50, 50).filter(bool), st.booleans())
def test_a_wrong_final_number_scores_zero(terms, rng, delta, check_steps):
    prompt = sum_prompt(terms)
    derivation = write_derivation(prompt, rng=rng)
    head, _, last = derivation.rpartition("=")
    wrong = f"{head}={int(last) + delta}"
    assert score(wrong, prompt, str(sum(terms)), check_steps=check_steps) == 0.0


@given(st.text(max_size=40), st.text(alphabet="0123456789+-=; ", max_size=40), st.integers(-1000, 1000))
def test_never_raises_on_completions(any_text, task_like_text, answer):
    for completion in (any_text, task_like_text):
        for check_steps in (False, True):
            assert score(completion, "12-7+30=", str(answer), check_steps) in (0.0, 1.0)


def test_a_conversation_is_scored_on_its_text_and_its_last_messages_sum():
    prompt = [{"role": "system", "content": "Show each step."}, {"role": "user", "content": "12-7+30="}]
    completions = [[{"role": "assistant", "content": text}] for text in ("12-7=5;5+30=35", "7+30=37;37-2=35")]
    reward = ReasoningReward(check_steps=True)
    assert reward(prompts=[prompt, prompt], completions=completions, answer=["35", "35"]) == [1.0, 0.0]

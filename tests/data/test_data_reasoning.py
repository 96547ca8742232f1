"""Tests for the synthetic reasoning task: determinism, families, split, the derivation writer, and the
shipped policy and config on it."""

import itertools
import random
from collections import Counter

import pytest

from exgrpo_pl.data import REASONING_ALPHABET, REASONING_FAMILIES, ReasoningTask, write_derivation
from exgrpo_pl.rewards import ReasoningReward
from exgrpo_pl.rewards.reasoning import parse_terms

ROWS = ReasoningTask().rows()


def test_deterministic_and_ids_stable():
    a, b = ReasoningTask(num_questions=500, seed=3), ReasoningTask(num_questions=500, seed=3)
    assert a.rows() == b.rows() and len(a) == 500
    assert [row["id"] for row in a.rows()] == list(range(500))
    assert a.rows() != ReasoningTask(num_questions=500, seed=4).rows()
    # Fewer questions: the first ones of the same stream.
    assert ReasoningTask(num_questions=300, seed=3).rows() == a.rows()[:300]


def test_default_pool_is_tens_of_thousands_of_distinct_questions():
    prompts = [row["prompt"] for row in ROWS]
    assert len(prompts) == 20000 and len(set(prompts)) == len(prompts)


def test_rows_are_sums_within_the_alphabet():
    for row in ROWS:
        assert set(row["prompt"] + row["answer"]) <= set(REASONING_ALPHABET)
        assert row["prompt"].endswith("=")
        assert int(row["answer"]) == sum(parse_terms(row["prompt"]))


def test_every_family_present_with_its_meaning():
    counts = Counter(row["domain"] for row in ROWS)
    assert set(counts) == set(REASONING_FAMILIES)
    assert counts["add2_1d"] == 100  # every one-digit pair, then the family is exhausted
    for row in ROWS:
        family, terms = row["domain"], parse_terms(row["prompt"])
        assert len(terms) == int(family[3])
        low, high = (0, 9) if family.endswith("1d") else (10, 99)
        assert all(low <= abs(t) <= high for t in terms)
        assert terms[0] >= 0
        assert ("-" in row["prompt"]) == family.startswith("mix")


def test_families_select():
    rows = ReasoningTask(num_questions=150, families=["add2_1d", "mix3_2d"]).rows()
    assert {row["domain"] for row in rows} == {"add2_1d", "mix3_2d"}


def test_split_is_deterministic_disjoint_and_stratified():
    task = ReasoningTask(num_questions=2000)
    train, val = task.split(0.1)
    assert (train, val) == task.split(0.1)
    train_ids, val_ids = {r["id"] for r in train}, {r["id"] for r in val}
    assert not train_ids & val_ids and len(train_ids | val_ids) == 2000
    assert abs(len(val) - 200) <= len(REASONING_FAMILIES)
    assert {r["domain"] for r in val} == set(REASONING_FAMILIES)
    assert task.split(0.0)[1] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_questions": 0}, "num_questions"),
        ({"families": ["mul"]}, "unknown family 'mul'"),
        ({"families": []}, "no families"),
        ({"num_questions": 150, "families": ["add2_1d"]}, "hold only 100"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReasoningTask(**kwargs)


def test_writer_examples():
    assert write_derivation("12-7+30=", order=[0, 1, 2]) == "12-7=5;5+30=35"
    assert write_derivation("12-7+30=", order=[1, 2, 0]) == "-7+30=23;23+12=35"
    assert write_derivation("4+5=", order=[1, 0]) == "5+4=9"
    rng_a, rng_b = random.Random(1), random.Random(1)
    assert [write_derivation("1+2+3+4=", rng=rng_a) for _ in range(5)] == [
        write_derivation("1+2+3+4=", rng=rng_b) for _ in range(5)
    ]
    with pytest.raises(ValueError, match=r"order \[0, 0\] is not a permutation of the 2 terms"):
        write_derivation("4+5=", order=[0, 0])


def test_the_writer_always_verifies_and_stays_short():
    reward = ReasoningReward(check_steps=True)
    lengths = []
    for row in ROWS[::20]:
        num_terms = len(parse_terms(row["prompt"]))
        orders = list(itertools.permutations(range(num_terms)))
        derivations = [write_derivation(row["prompt"], order=order) for order in orders]
        n = len(orders)
        assert reward([row["prompt"]] * n, derivations, answer=[row["answer"]] * n) == [1.0] * n
        if len(set(parse_terms(row["prompt"]))) == num_terms:
            assert len(set(derivations)) == n  # distinct terms: every order reads differently
        lengths += [len(d) for d in derivations]
    assert max(lengths) <= 28 and sorted(lengths)[len(lengths) * 9 // 10] <= 24

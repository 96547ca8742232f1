"""Tests for the synthetic arithmetic task: determinism, stable ids, families, alphabet, split."""

from collections import Counter

import pytest

from exgrpo_pl.data import ARITHMETIC_ALPHABET, FAMILIES, ArithmeticTask


def test_deterministic_and_ids_stable():
    a, b = ArithmeticTask(num_questions=500, seed=3), ArithmeticTask(num_questions=500, seed=3)
    assert a.rows() == b.rows()
    assert [row["id"] for row in a.rows()] == list(range(500))
    assert a.rows() != ArithmeticTask(num_questions=500, seed=4).rows()


def test_rows_are_correct_and_within_the_alphabet():
    for row in ArithmeticTask(num_questions=2000).rows():
        prompt = row["prompt"]
        assert set(prompt + row["answer"]) <= set(ARITHMETIC_ALPHABET)
        assert prompt.endswith("=") and " " not in prompt
        op = "+" if "+" in prompt else "-"
        a, b = (int(x) for x in prompt[:-1].split(op))
        assert int(row["answer"]) == (a + b if op == "+" else a - b)


def test_prompts_are_distinct():
    prompts = [row["prompt"] for row in ArithmeticTask(num_questions=2000).rows()]
    assert len(set(prompts)) == len(prompts)


def test_every_family_present_with_its_meaning():
    rows = ArithmeticTask(num_questions=2000).rows()
    counts = Counter(row["domain"] for row in rows)
    assert set(counts) == set(FAMILIES)
    by_family = {family: [row for row in rows if row["domain"] == family] for family in FAMILIES}
    assert all(len(row["prompt"]) <= 4 for row in by_family["add_1d"])  # "3+4="
    assert any(row["answer"].startswith("-") for row in by_family["sub_1d"])
    assert all(row["answer"].startswith("-") for row in by_family["sub_negative"])
    for row in by_family["add_carry"]:
        a, b = (int(x) for x in row["prompt"][:-1].split("+"))
        assert (a % 10 + b % 10 >= 10) or (a // 10 + b // 10 >= 10)
    for row in by_family["sub_borrow"]:
        a, b = (int(x) for x in row["prompt"][:-1].split("-"))
        assert a >= b and a % 10 < b % 10


def test_operations_and_families_select():
    assert {r["domain"] for r in ArithmeticTask(num_questions=300, operations=("+",)).rows()} <= {
        "add_1d",
        "add_nocarry",
        "add_carry",
    }
    rows = ArithmeticTask(num_questions=50, families=["add_1d"]).rows()
    assert {r["domain"] for r in rows} == {"add_1d"}


def test_split_is_deterministic_disjoint_and_stratified():
    task = ArithmeticTask(num_questions=1000)
    train, val = task.split(0.2)
    assert (train, val) == task.split(0.2)
    train_ids, val_ids = {r["id"] for r in train}, {r["id"] for r in val}
    assert not train_ids & val_ids and len(train_ids | val_ids) == 1000
    assert abs(len(val) - 200) <= len(FAMILIES)
    assert {r["domain"] for r in val} == set(FAMILIES)
    assert task.split(0.0)[1] == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_questions": 0}, "num_questions"),
        ({"max_operand": 9}, "max_operand"),
        ({"operations": ("*",)}, "operations"),
        ({"families": ["mul"]}, "unknown family 'mul'"),
        ({"operations": ("+",), "families": ["sub_1d"]}, "family 'sub_1d' uses '-'"),
        ({"num_questions": 250, "families": ["add_1d", "sub_1d"]}, "hold only"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)

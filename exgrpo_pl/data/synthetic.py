"""Synthetic arithmetic task: "37+45=" -> "82", a verifiable task a tiny model learns on a CPU in minutes.

Questions come in difficulty families, which are their `domain`, so per-domain statistics show the
curriculum: one-digit sums a small model nearly always gets right, up to multi-digit subtractions with
borrows or negative results it nearly never does at first. Everything is deterministic in the seed and the
configuration: the same arguments give the same rows with the same ids, whatever split is taken later.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from exgrpo_pl.data.task import GeneratedTask
from exgrpo_pl.validation import check_number

ARITHMETIC_ALPHABET = "0123456789+-="
"""Every character a prompt or answer of the task can contain (tokenizers are built over it)."""


def _digits(n: int) -> list[int]:
    return [int(d) for d in reversed(str(n))]


def _carries(a: int, b: int) -> bool:
    # A carry happens iff some column's digits alone reach 10: without one, no carry ever starts.
    da, db = _digits(a), _digits(b)
    return any(x + y >= 10 for x, y in zip(da, db, strict=False))


def _borrows(a: int, b: int) -> bool:
    # For a >= b, a borrow happens iff some column's top digit is smaller than the bottom one.
    da, db = _digits(a), _digits(b)
    return any(x < y for x, y in zip(da, db, strict=False))


# family -> (operation, multi-digit operands?, constraint on the operand pair)
_FAMILIES: dict[str, tuple[str, bool, Callable[[int, int], bool]]] = {
    "add_1d": ("+", False, lambda a, b: True),
    "add_nocarry": ("+", True, lambda a, b: not _carries(a, b)),
    "add_carry": ("+", True, _carries),
    "sub_1d": ("-", False, lambda a, b: True),
    "sub_noborrow": ("-", True, lambda a, b: a >= b and not _borrows(a, b)),
    "sub_borrow": ("-", True, lambda a, b: a >= b and _borrows(a, b)),
    "sub_negative": ("-", True, lambda a, b: a < b),
}
FAMILIES = tuple(_FAMILIES)
"""All difficulty families, roughly easiest first within each operation."""

# Draws allowed to satisfy a family's constraint; enough for any max_operand up to about 10**9.
_MAX_REJECTIONS = 100_000


class ArithmeticTask(GeneratedTask):
    """A fixed, seeded set of distinct addition/subtraction questions with integer answers.

    Each question picks a family uniformly among those not yet exhausted (one-digit families hold only 100
    distinct questions each), then operands uniformly among the pairs that satisfy the family. One-digit
    operands are 0-9, multi-digit ones 10..max_operand. Ids are 0..num_questions-1 in generation order.

    Args:
        num_questions: how many distinct questions to generate.
        seed: seeds generation and `split`.
        max_operand: largest multi-digit operand; at least 20 so that every family can be drawn.
        operations: which of "+" and "-" to use.
        families: which families (see `FAMILIES`) to use; None uses all of the chosen operations'.

    Raises:
        ValueError: on an invalid argument, or if the families hold fewer than `num_questions` questions.
    """

    def __init__(
        self,
        num_questions: int = 2000,
        seed: int = 0,
        max_operand: int = 99,
        operations: Sequence[str] = ("+", "-"),
        families: Sequence[str] | None = None,
    ) -> None:
        check_number("ArithmeticTask", "num_questions", num_questions, 1, integer=True)
        check_number("ArithmeticTask", "seed", seed, integer=True)
        check_number("ArithmeticTask", "max_operand", max_operand, 20, integer=True)
        unknown_ops = set(operations) - {"+", "-"}
        if unknown_ops or not operations:
            raise ValueError(
                f"ArithmeticTask: operations must be a non-empty subset of ('+', '-'), got {operations}"
            )
        if families is None:
            families = [name for name, (op, _, _) in _FAMILIES.items() if op in operations]
        for name in families:
            if name not in _FAMILIES:
                raise ValueError(f"ArithmeticTask: unknown family {name!r}; known: {', '.join(FAMILIES)}")
            if _FAMILIES[name][0] not in operations:
                raise ValueError(
                    f"ArithmeticTask: family {name!r} uses {_FAMILIES[name][0]!r}, not in {operations}"
                )
        if not families:
            raise ValueError("ArithmeticTask: no families selected")
        self.max_operand = max_operand
        self.operations = tuple(operations)
        super().__init__(num_questions, seed, families)

    def _question(self, rng: random.Random, family: str) -> tuple[str, int]:
        op, multi_digit, allowed = _FAMILIES[family]
        low, high = (10, self.max_operand) if multi_digit else (0, 9)
        for _ in range(_MAX_REJECTIONS):
            # rng.random() only: unlike randrange, its stream is guaranteed across Python versions.
            a = low + int(rng.random() * (high - low + 1))
            b = low + int(rng.random() * (high - low + 1))
            if allowed(a, b):
                return f"{a}{op}{b}=", a + b if op == "+" else a - b
        raise ValueError(
            f"ArithmeticTask: could not draw a {family!r} question with max_operand={self.max_operand}"
        )

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(num_questions={self.num_questions}, seed={self.seed}, "
            f"max_operand={self.max_operand}, operations={self.operations}, families={self.families})"
        )

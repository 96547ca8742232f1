"""Exact verifier for the synthetic arithmetic task (`exgrpo_pl.data.ArithmeticTask`).

A completion is correct iff the integer it starts with equals the answer: "82", " 82", "82<eos>garbage" are
right for "37+45=", "8", "820" and "+82" are not. A conversational completion (TRL's one assistant message)
is scored on its text.
"""

from __future__ import annotations

import re
from typing import Any

from exgrpo_pl.rewards.base import AnswerReward

# ASCII digits only: \d would also accept other scripts' digits, which the task never produces.
_LEADING_INTEGER = re.compile(r"\s*(-?)([0-9]+)")
_INTEGER = re.compile(r"\s*(-?)([0-9]+)\s*")


def _canonical(sign: str, digits: str) -> str:
    # Compared as text, not int(): int() refuses strings over 4300 digits and a model can emit those.
    digits = digits.lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


class ArithmeticReward(AnswerReward):
    """1.0 when the completion's leading integer equals the `answer` column (a string or an int), else 0.0.

    Args:
        name: the name its scores are logged under.

    Raises:
        ValueError: when called with an answer that is not an integer, naming its row.
    """

    # Linear-time work on a bounded completion: nothing for a time limit to stop, so no worker process.
    in_process = True

    def __init__(self, name: str = "arithmetic") -> None:
        self.name = name

    def extract_answer(self, completion: str) -> str | None:
        """The completion's leading integer, canonical (the answer majority voting compares), or None."""
        got = _LEADING_INTEGER.match(completion)
        return None if got is None else _canonical(*got.groups())

    def score(self, completion: str, answer: Any, row: int) -> float:
        expected = _INTEGER.fullmatch(str(answer))
        if expected is None:
            raise ValueError(f"{self.name}: answer {answer!r} of row {row} is not an integer")
        got = _LEADING_INTEGER.match(completion)
        return 1.0 if got is not None and _canonical(*got.groups()) == _canonical(*expected.groups()) else 0.0

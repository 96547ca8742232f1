"""Verifier for step-by-step derivations of sums (`exgrpo_pl.data.ReasoningTask`).

A derivation is one or more steps separated by ";", each "X+Y=Z" or "X-Y=Z" with integers (X and Z may be
negative), e.g. "12-7=5;5+30=35" for the prompt "12-7+30=". Its result is the Z of the last step. Whitespace
is ignored and one trailing ";" is allowed; anything else that is not a step makes the completion wrong.

With `check_steps`, the derivation must also be a proof: the prompt's signed terms (12, -7 and 30 above) form
a pool; each step takes two values out of the pool, X and the signed second operand (-Y for "X-Y"), and puts
X+Y back, which must be the Z it wrote; at the end exactly the last Z must be left. So every term is used
exactly once, in any order and grouping: "30-7=23;23+12=35" and "-7+30=23;12+23=35" prove it too.

A conversational completion (TRL's one assistant message) is scored on its text, and a conversational
prompt's sum is its last message's content.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from exgrpo_pl.rewards.base import Completion, Prompt, completion_text

# ASCII digits only: \d would also accept other scripts' digits, which the task never produces.
_STEP = re.compile(r"(-?[0-9]+)([+-])([0-9]+)=(-?[0-9]+)")
_PROMPT = re.compile(r"-?[0-9]+(?:[+-][0-9]+)+=")
_TERM = re.compile(r"[+-]?[0-9]+")
_INTEGER = re.compile(r"-?[0-9]+")


def _canonical(number: str) -> str:
    # The answer as the text str(int()) would give, without int(), which refuses over 4300 digits.
    sign, digits = ("-", number[1:]) if number.startswith("-") else ("", number)
    digits = digits.lstrip("0") or "0"
    return digits if digits == "0" else sign + digits


def parse_terms(prompt: str) -> list[int]:
    """The signed terms of a sum prompt: "12-7+30=" -> [12, -7, 30].

    Args:
        prompt: two or more integers joined by "+" or "-", then "="; whitespace is ignored.

    Raises:
        ValueError: if `prompt` is not of that form.
    """
    text = "".join(prompt.split())
    if not _PROMPT.fullmatch(text):
        raise ValueError(f"prompt {prompt!r} is not a sum of integers such as '12-7+30='")
    return [int(term) for term in _TERM.findall(text[:-1])]


def parse_steps(completion: str) -> list[tuple[int, int, int]] | None:
    """The steps of a derivation as `(x, signed_y, z)`: "12-7=5;5+30=35" -> [(12, -7, 5), (5, 30, 35)].

    Returns:
        The steps, or None when the completion is not a derivation (or holds a number too long for int()).
    """
    parts = "".join(completion.split()).split(";")
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()
    steps = []
    for part in parts:
        match = _STEP.fullmatch(part)
        if match is None:
            return None
        x, op, y, z = match.groups()
        try:
            steps.append((int(x), int(y) if op == "+" else -int(y), int(z)))
        except ValueError:  # over Python's int() digit limit
            return None
    return steps


def proves(terms: list[int], steps: list[tuple[int, int, int]]) -> bool:
    """Whether `steps` use exactly `terms`, each once, with every step's sum right (see the module doc)."""
    pool = Counter(terms)
    for x, y, z in steps:
        pool[x] -= 1
        pool[y] -= 1
        if pool[x] < 0 or pool[y] < 0 or x + y != z:
            return False
        pool[z] += 1
    return +pool == Counter([steps[-1][2]]) if steps else False


class ReasoningReward:
    """1.0 when a derivation's result equals the `answer` column (and, with `check_steps`, proves it).

    Follows the TRL reward protocol. Model output never raises: what does not parse scores 0.0.

    Args:
        check_steps: also require every step to be right and the steps to combine exactly the prompt's
            terms (see the module docstring); without it only the last step's result counts.
        name: the name its scores are logged under.

    Raises:
        ValueError: when called with an answer that is not an integer, or (with `check_steps`) a prompt that
            is not a sum, naming its row.
    """

    # Linear-time work on a bounded completion: nothing for a time limit to stop, so no worker process.
    in_process = True

    def __init__(self, check_steps: bool = False, name: str = "reasoning") -> None:
        self.check_steps = check_steps
        self.name = name

    def __call__(
        self, prompts: list[Prompt], completions: list[Completion], answer: list[Any], **columns: Any
    ) -> list[float]:
        """Scores each completion against its prompt and answer.

        Args:
            prompts: the prompts (read only with `check_steps`): text, or chat messages whose last one
                holds the sum.
            completions: the model's completions: text, or conversational (see `completion_text`).
            answer: the reference answers, one per row.
            **columns: other dataset columns (unused).
        """
        rows = zip(prompts, completions, answer, strict=True)
        return [
            self.score(completion_text(p), completion_text(c), a, row) for row, (p, c, a) in enumerate(rows)
        ]

    def extract_answer(self, completion: str) -> str | None:
        """The derivation's result, its last step's (the answer majority voting compares), or None."""
        steps = parse_steps(completion)
        return str(steps[-1][2]) if steps else None

    def score(self, prompt: str, completion: str, answer: Any, row: int = 0) -> float:
        """1.0 for a correct derivation, else 0.0; `row` is for error messages."""
        expected = "".join(str(answer).split())
        if not _INTEGER.fullmatch(expected):
            raise ValueError(f"{self.name}: answer {answer!r} of row {row} is not an integer")
        if self.check_steps:
            try:
                terms = parse_terms(prompt)
            except ValueError as err:
                raise ValueError(f"{self.name}: row {row}: {err}") from err
        steps = parse_steps(completion)
        if not steps or str(steps[-1][2]) != _canonical(expected):
            return 0.0
        return 1.0 if not self.check_steps or proves(terms, steps) else 0.0

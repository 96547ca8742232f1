"""Synthetic reasoning task: sums of 2-4 terms worked out step by step, in any order the model likes.

"12-7+30=" is answered by a short derivation such as "12-7=5;5+30=35" or "30-7=23;23+12=35" (verified by
`exgrpo_pl.rewards.ReasoningReward`). Unlike `ArithmeticTask`, whose right answers to a question are nearly
all the same string, a question here has several right completions that differ in text and in how sure the
policy was of them, which is what ExGRPO's lowest-entropy choice among a question's correct trajectories
needs.

Questions come in difficulty families (their `domain`): the number of terms, one- or two-digit operands, and
whether some terms are subtracted. Three more families, with three-digit operands, are never drawn unless
asked for (`REASONING_OOD_FAMILIES`): larger numbers than any training question, an out-of-distribution set
for a policy trained on the others. Everything is deterministic in the seed and the configuration, as in
`ArithmeticTask`: the same arguments give the same rows with the same ids, whatever split is taken later.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from exgrpo_pl.data.task import GeneratedTask
from exgrpo_pl.rewards.reasoning import parse_terms
from exgrpo_pl.validation import check_number

REASONING_ALPHABET = "0123456789+-=;"
"""Every character a prompt or derivation of the task can contain (tokenizers are built over it)."""

# family -> (number of terms, digits of the operands, some terms subtracted?)
_FAMILIES: dict[str, tuple[int, int, bool]] = {
    "add2_1d": (2, 1, False),
    "add3_1d": (3, 1, False),
    "add4_1d": (4, 1, False),
    "mix3_1d": (3, 1, True),
    "mix4_1d": (4, 1, True),
    "add2_2d": (2, 2, False),
    "add3_2d": (3, 2, False),
    "mix3_2d": (3, 2, True),
    # Out of distribution: drawn only when named. Each derivation fits MAX_DERIVATION_LENGTH
    # ("999+999=1998;1998+999=2997" is 26 characters).
    "add2_3d": (2, 3, False),
    "mix2_3d": (2, 3, True),
    "add3_3d": (3, 3, False),
}
REASONING_OOD_FAMILIES = ("add2_3d", "mix2_3d", "add3_3d")
"""Families with three-digit operands, which a task draws only when asked: an out-of-distribution set."""
REASONING_FAMILIES = tuple(name for name in _FAMILIES if name not in REASONING_OOD_FAMILIES)
"""The families a task draws by default, roughly easiest first within each operand size."""

MAX_DERIVATION_LENGTH = 28
"""The longest derivation `write_derivation` writes for a question of the task: "9-9-9-9=" from its negatives,
"-9-9=-18;-18-9=-27;-27+9=-18". A policy needs one more token for EOS."""


def write_derivation(
    prompt: str, order: Sequence[int] | None = None, rng: random.Random | None = None
) -> str:
    """A correct derivation of a sum prompt that adds its signed terms one at a time in a given order.

    "12-7+30=" with order (1, 2, 0) gives "-7+30=23;23+12=35": the first step combines the first two terms
    of the order, each later step the running result and the next term.

    Args:
        prompt: a sum such as "12-7+30=".
        order: a permutation of the term indices; None draws one uniformly with `rng`.
        rng: the random source for `order`; None means a fresh unseeded one.

    Raises:
        ValueError: if `prompt` is not a sum or `order` is not a permutation of its term indices.
    """
    terms = parse_terms(prompt)
    if order is None:
        order = list(range(len(terms)))
        (rng or random.Random()).shuffle(order)
    if sorted(order) != list(range(len(terms))):
        raise ValueError(f"order {list(order)} is not a permutation of the {len(terms)} terms of {prompt!r}")
    total = terms[order[0]]
    steps = []
    for index in order[1:]:
        term = terms[index]
        steps.append(f"{total}{'+' if term >= 0 else '-'}{abs(term)}={total + term}")
        total += term
    return ";".join(steps)


class ReasoningTask(GeneratedTask):
    """A fixed, seeded set of distinct sum questions whose answers are step-by-step derivations.

    Each question picks a family uniformly among those not yet exhausted (the one-digit families hold 100 to
    70,000 distinct questions), then operands uniformly: one-digit ones 0-9, two-digit ones 10-99,
    three-digit ones 100-999; in the
    "mix" families each term after the first is subtracted with probability 1/2, redrawn until at least one
    is. Ids are 0..num_questions-1 in generation order. Rows are `{"id", "prompt", "answer", "domain"}` with
    the final result as `answer`: any correct derivation earns the reward.

    Args:
        num_questions: how many distinct questions to generate.
        seed: seeds generation and `split`.
        families: which families to use (`REASONING_FAMILIES`, or the out-of-distribution
            `REASONING_OOD_FAMILIES`); None uses `REASONING_FAMILIES`.

    Raises:
        ValueError: on an invalid argument, or if the families hold fewer than `num_questions` questions.
    """

    def __init__(
        self, num_questions: int = 20000, seed: int = 0, families: Sequence[str] | None = None
    ) -> None:
        check_number("ReasoningTask", "num_questions", num_questions, 1, integer=True)
        check_number("ReasoningTask", "seed", seed, integer=True)
        families = REASONING_FAMILIES if families is None else tuple(families)
        for name in families:
            if name not in _FAMILIES:
                known = ", ".join(_FAMILIES)
                raise ValueError(f"ReasoningTask: unknown family {name!r}; known: {known}")
        if not families:
            raise ValueError("ReasoningTask: no families selected")
        super().__init__(num_questions, seed, families)

    def _question(self, rng: random.Random, family: str) -> tuple[str, int]:
        num_terms, digits, subtract = _FAMILIES[family]
        low, high = (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
        # rng.random() only: unlike randrange, its stream is guaranteed across Python versions.
        magnitudes = [low + int(rng.random() * (high - low + 1)) for _ in range(num_terms)]
        ops = ["+"] * (num_terms - 1)
        while subtract and "-" not in ops:
            ops = ["-" if rng.random() < 0.5 else "+" for _ in ops]
        # Signs stay in the text, so "5-0+3=" keeps its subtraction although -0 == 0.
        prompt = str(magnitudes[0]) + "".join(op + str(m) for op, m in zip(ops, magnitudes[1:])) + "="
        answer = magnitudes[0] + sum(m if op == "+" else -m for op, m in zip(ops, magnitudes[1:]))
        return prompt, answer

    def __repr__(self) -> str:
        return (
            f"ReasoningTask(num_questions={self.num_questions}, seed={self.seed}, families={self.families})"
        )

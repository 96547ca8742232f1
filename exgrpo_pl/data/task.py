"""Generated tasks: `SyntheticTask`, what `PromptDataModule` needs of one, and `GeneratedTask`, the base of
`ArithmeticTask` and `ReasoningTask`.

`SyntheticTask` is a structural protocol, so a config selects any class with its two methods by `class_path`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Protocol

from exgrpo_pl.data.loading import split_rows

# A family whose next this-many draws are all already-used questions counts as exhausted.
_MAX_REPEATS = 1000


class SyntheticTask(Protocol):
    """A fixed, seeded set of questions as rows `{"id", "prompt", "answer", "domain"}`."""

    def rows(self) -> list[dict[str, Any]]:
        """All questions, in id order."""
        ...

    def split(self, val_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Deterministic, disjoint `(train_rows, val_rows)` with `val_fraction` of the rows in validation."""
        ...


class GeneratedTask:
    """A fixed set of distinct questions drawn from a seeded stream, family by family.

    Each question picks a family uniformly among those not yet exhausted, then a question of it
    (`_question`); a question drawn before is drawn again. Ids are 0..num_questions-1 in generation order,
    and the same arguments give the same rows, whatever split is taken later.

    Args:
        num_questions: how many distinct questions to generate.
        seed: seeds generation and `split`.
        families: the families to draw from (the subclass's names).
    """

    def __init__(self, num_questions: int, seed: int, families: Sequence[str]) -> None:
        self.num_questions = num_questions
        self.seed = seed
        self.families = tuple(families)
        self._rows = self._generate()

    def _question(self, rng: random.Random, family: str) -> tuple[str, int]:
        """One question of `family` drawn with `rng`: its prompt and its integer answer."""
        raise NotImplementedError

    def _generate(self) -> list[dict[str, Any]]:
        rng = random.Random(self.seed)
        active = list(self.families)
        repeats = dict.fromkeys(active, 0)
        seen: set[str] = set()
        rows: list[dict[str, Any]] = []
        while len(rows) < self.num_questions:
            if not active:
                raise ValueError(
                    f"{self!r}: its families hold only {len(rows)} distinct questions; lower num_questions"
                )
            family = active[int(rng.random() * len(active))]
            prompt, answer = self._question(rng, family)
            if prompt in seen:
                repeats[family] += 1
                if repeats[family] >= _MAX_REPEATS:
                    active.remove(family)
                continue
            repeats[family] = 0
            seen.add(prompt)
            rows.append({"id": len(rows), "prompt": prompt, "answer": str(answer), "domain": family})
        return rows

    def rows(self) -> list[dict[str, Any]]:
        """All questions, in id order, as `{"id", "prompt", "answer", "domain"}` dicts (fresh copies)."""
        return [dict(row) for row in self._rows]

    def split(self, val_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Deterministic, disjoint train/validation split, stratified by family.

        Args:
            val_fraction: share of each family that goes to validation, in [0, 1).

        Returns:
            `(train_rows, val_rows)`, each in id order.
        """
        return split_rows(self.rows(), val_fraction, seed=self.seed)

    def __len__(self) -> int:
        return len(self._rows)

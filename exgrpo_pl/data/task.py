"""`SyntheticTask`: what `PromptDataModule` needs of a generated task such as `ArithmeticTask`.

A structural protocol, so a config selects any class with these two methods by `class_path`.
"""

from __future__ import annotations

from typing import Any, Protocol


class SyntheticTask(Protocol):
    """A fixed, seeded set of questions as rows `{"id", "prompt", "answer", "domain"}`."""

    def rows(self) -> list[dict[str, Any]]:
        """All questions, in id order."""
        ...

    def split(self, val_fraction: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Deterministic, disjoint `(train_rows, val_rows)` with `val_fraction` of the rows in validation."""
        ...

"""Format reward: does the whole completion (its text, when conversational) match a regular expression (e.g.
a think/answer template)?"""

from __future__ import annotations

import re
from typing import Any

from exgrpo_pl.rewards.base import Completion, Prompt, completion_text


class FormatReward:
    """1.0 when `re.fullmatch(pattern, completion, re.DOTALL)` succeeds, else 0.0.

    Args:
        pattern: the regular expression the whole completion must match; `.` also matches newlines.
        name: the name its scores are logged under; give two FormatRewards distinct names.

    Raises:
        ValueError: if `pattern` is not a valid regular expression.
    """

    def __init__(self, pattern: str, name: str = "format") -> None:
        try:
            self._regex = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ValueError(f"FormatReward: invalid regular expression {pattern!r}: {err}") from err
        self.pattern = pattern
        self.name = name

    def __call__(
        self, prompts: list[Prompt], completions: list[Completion], **columns: Any
    ) -> list[float | None]:
        """Scores each completion.

        Args:
            prompts: the prompts (unused).
            completions: the model's completions: text, or conversational (see `completion_text`).
            **columns: dataset columns (unused).
        """
        return [1.0 if self._regex.fullmatch(completion_text(c)) else 0.0 for c in completions]

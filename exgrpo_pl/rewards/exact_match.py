"""Exact-match verifier: the completion (its text, when conversational) must be the answer, up to case and
whitespace."""

from __future__ import annotations

from typing import Any

from exgrpo_pl.rewards.base import AnswerReward


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


class ExactMatchReward(AnswerReward):
    """1.0 when the completion equals the `answer` column (non-strings compared as their `str`), else 0.0.

    Args:
        normalize: compare stripped, casefolded text with whitespace runs collapsed to one space; if False,
            compare the raw strings.
        name: the name its scores are logged under.
    """

    # Linear-time work on a bounded completion: nothing for a time limit to stop, so no worker process.
    in_process = True

    def __init__(self, normalize: bool = True, name: str = "exact_match") -> None:
        self.normalize = normalize
        self.name = name

    def extract_answer(self, completion: str) -> str | None:
        """The completion as it is compared (the answer majority voting compares)."""
        return _normalize(completion) if self.normalize else completion

    def score(self, completion: str, answer: Any, row: int) -> float:
        got, expected = completion, str(answer)
        if self.normalize:
            got, expected = _normalize(got), _normalize(expected)
        return 1.0 if got == expected else 0.0

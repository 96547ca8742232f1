"""Exact-match verifier: the completion must be the answer, up to case and whitespace."""

from __future__ import annotations

from typing import Any


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


class ExactMatchReward:
    """1.0 when the completion equals the `answer` column, else 0.0.

    Args:
        normalize: compare stripped, casefolded text with whitespace runs collapsed to one space; if False,
            compare the raw strings.
        name: the name its scores are logged under.
    """

    def __init__(self, normalize: bool = True, name: str = "exact_match") -> None:
        self.normalize = normalize
        self.name = name

    def __call__(
        self, prompts: list[str], completions: list[str], answer: list[Any], **columns: Any
    ) -> list[float | None]:
        """Scores each completion against its answer.

        Args:
            prompts: the prompts (unused).
            completions: the model's completions.
            answer: the reference answers (non-strings are compared as their `str`).
            **columns: other dataset columns (unused).
        """
        scores: list[float | None] = []
        for completion, reference in zip(completions, answer, strict=True):
            got, expected = completion, str(reference)
            if self.normalize:
                got, expected = _normalize(got), _normalize(expected)
            scores.append(1.0 if got == expected else 0.0)
        return scores

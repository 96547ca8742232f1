"""The reward-function protocol and the code that turns several reward functions into one reward per row.

The protocol is TRL's, so a TRL reward function drops in unchanged: it is called with the prompts, the
completions and every other dataset column as a keyword list of the same length, and returns one float per
row, or `None` where it does not apply to that row. Core module: no Lightning.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class RewardFunction(Protocol):
    """A verifier or shaping term: scores N completions of N prompts.

    Dataset columns other than the prompt (e.g. `answer`, `domain`) arrive as keyword lists of length N, so
    an implementation takes the columns it needs by name and swallows the rest with `**columns`.
    """

    def __call__(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]: ...


class AnswerReward(ABC):
    """Base of the verifiers that score each completion against its row's `answer` column, row by row."""

    name: str

    def __call__(
        self, prompts: list[str], completions: list[str], answer: list[Any], **columns: Any
    ) -> list[float]:
        """Scores each completion against its answer.

        Args:
            prompts: the prompts (unused).
            completions: the model's completions.
            answer: the reference answers, one per row.
            **columns: other dataset columns (unused).
        """
        return [self.score(c, a, row) for row, (c, a) in enumerate(zip(completions, answer, strict=True))]

    @abstractmethod
    def score(self, completion: str, answer: Any, row: int) -> float:
        """1.0 for a correct completion, else 0.0; `row` is for error messages."""


def reward_name(fn: Callable[..., Any]) -> str:
    """The name a reward function's values are logged under.

    An explicit string `name` attribute wins; otherwise a function's `__name__` (as TRL does) and, for any
    other callable, its class name.

    Args:
        fn: the reward function.
    """
    name = getattr(fn, "name", None)
    if isinstance(name, str) and name:
        return name
    return getattr(fn, "__name__", None) or type(fn).__name__


def compute_rewards(
    funcs: Sequence[Callable[..., Sequence[float | None]]],
    weights: Sequence[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: Mapping[str, list[Any]],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scores every row with every function and sums the weighted scores.

    A `None` score becomes `nan` in that function's tensor and drops out of the weighted sum (a nansum, as
    TRL does); a row no function applies to gets a total of 0 and a warning.

    Args:
        funcs: the reward functions, each following `RewardFunction`.
        weights: one weight per function; `None` weighs every function 1.0.
        prompts: `N` prompt strings.
        completions: `N` completion strings.
        columns: the other dataset columns, each a list of `N` values, passed to every function by name.

    Returns:
        `(total, per_function)`: `total` is a `[N]` float32 tensor; `per_function` maps each function's name
        (see `reward_name`) to its `[N]` float32 scores, `nan` where it returned `None`.

    Raises:
        ValueError: on no functions, a weights/functions or column/prompt length mismatch, two functions with
            the same name, or a function returning the wrong number of scores.
    """
    if not funcs:
        raise ValueError("compute_rewards needs at least one reward function")
    if weights is None:
        weights = [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(funcs)} reward functions")
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"got {len(completions)} completions for {n} prompts")
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} prompts")

    per_function: dict[str, Tensor] = {}
    for fn in funcs:
        name = reward_name(fn)
        if name in per_function:
            raise ValueError(f"two reward functions are named {name!r}; give them distinct `name` attributes")
        scores = fn(prompts=prompts, completions=completions, **columns)
        if len(scores) != n:
            raise ValueError(f"reward function {name!r} returned {len(scores)} scores for {n} completions")
        per_function[name] = torch.tensor(
            [math.nan if s is None else float(s) for s in scores], dtype=torch.float32
        )

    stacked = torch.stack(list(per_function.values()), dim=1)  # [N, F]
    weight = torch.tensor([float(w) for w in weights], dtype=torch.float32)  # [F]
    total = (stacked * weight).nansum(dim=1)  # [N]
    if n and stacked.isnan().all(dim=1).any():
        # Constant text so Python's warning registry reports it once per process, not once per step.
        warnings.warn(
            "every reward function returned None for some rows; their total reward is 0",
            stacklevel=2,
        )
    return total, per_function

"""The reward-function protocol and the code that turns several reward functions into one reward per row.

The protocol is TRL's, so a TRL reward function drops in unchanged: it is called with the prompts, the
completions and every other dataset column as a keyword list of the same length, and returns one float per
row, or `None` where it does not apply to that row. As in TRL, a prompt is text or a list of chat messages
(conversational), and a conversational prompt's completion is a list of one message, `[{"role":
"assistant", "content": text}]`; `completion_text` gives the text of either kind, and the shipped rewards
take both. `compute_rewards` checks what each function returns (a NaN, an infinite score or a wrong type is
an error naming the function and the row) and can put a time limit on each call, which holds whatever the
function does: the call runs in a worker process that is killed when it runs over. Core module: no
Lightning.
"""

from __future__ import annotations

import math
import numbers
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from exgrpo_pl.rewards.worker import NotSendable, WorkerProcess

Messages = list[dict[str, str]]
"""Chat messages, TRL's conversational format: `[{"role": "user", "content": "What is 1+1?"}, ...]`."""
Prompt = str | Messages
"""A prompt: text, or chat messages."""
Completion = str | Messages
"""A completion as reward functions receive it: text, or (for a conversational prompt) one assistant
message."""


REWARD_ARGUMENTS = (
    "prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments",
)  # fmt: skip
"""The keyword arguments reward functions get from the trainer itself (here and in TRL), not from the
dataset: a dataset column with one of these names would replace the argument in every reward call, so it is
an error (`compute_rewards`; the data module names the file and row before training)."""


def completion_text(completion: Completion) -> str:
    """The text of a completion: itself, or a conversational completion's last message's content.

    TRL's own rewards read `completion[0]["content"]` of a conversational completion, which holds one
    message; the last message is the same there. For a conversational prompt it is the last message too
    (the question, in the usual system-then-user layout).

    Args:
        completion: text, or a list of messages whose last one has a string `content`.

    Raises:
        TypeError: on anything else, naming what it got.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(
        "expected a completion text or a list of messages ending in one with a string 'content', got "
        f"{_describe(completion)}"
    )


@runtime_checkable
class RewardFunction(Protocol):
    """A verifier or shaping term: scores N completions of N prompts.

    Dataset columns other than the prompt (e.g. `answer`, `domain`) arrive as keyword lists of length N, so
    an implementation takes the columns it needs by name and swallows the rest with `**columns`.

    Under a time limit `compute_rewards` runs it in a worker process, so it must be picklable by reference
    (defined at the top level of an importable module) and what it changes in itself stays there. An
    optional attribute `in_process = True` has it called in the caller's process instead, without the
    limit: for functions that cannot run long (the shipped linear-time verifiers), or that must run here (a
    model on the GPU, state the run reads).
    """

    def __call__(
        self, prompts: list[Prompt], completions: list[Completion], **columns: Any
    ) -> list[float | None]: ...


class AnswerReward(ABC):
    """Base of the verifiers that score each completion against its row's `answer` column, row by row."""

    name: str

    def __call__(
        self, prompts: list[Prompt], completions: list[Completion], answer: list[Any], **columns: Any
    ) -> list[float]:
        """Scores each completion against its answer.

        Args:
            prompts: the prompts (unused).
            completions: the model's completions: text, or conversational (see `completion_text`).
            answer: the reference answers, one per row.
            **columns: other dataset columns (unused).
        """
        rows = enumerate(zip(completions, answer, strict=True))
        return [self.score(completion_text(c), a, row) for row, (c, a) in rows]

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


class RewardTimeoutError(TimeoutError):
    """A reward function ran past `compute_rewards`'s `timeout_seconds`.

    Attributes:
        name: the function's logged name (see `reward_name`).
        num_completions: how many completions the call was scoring.
        timeout_seconds: the limit it ran past.
    """

    def __init__(self, name: str, num_completions: int, timeout_seconds: float) -> None:
        super().__init__(
            f"reward function {name!r} did not return within {timeout_seconds:g} s scoring {num_completions} "
            "completions; raise the limit (`timeout_seconds`, ExGRPOModule's `reward_timeout_seconds`; None "
            "for no limit) or make the function faster. Its worker process was killed"
        )
        self.name = name
        self.num_completions = num_completions
        self.timeout_seconds = timeout_seconds

    def __reduce__(self):
        # Rebuilt from its fields, not its message, so it survives pickling (e.g. from a spawned DDP worker).
        return type(self), (self.name, self.num_completions, self.timeout_seconds)


class RewardNotSendableError(TypeError):
    """A reward function that has to run in a worker process (see `RewardFunction`) cannot get there."""


# The worker process that runs reward functions under a limit: one per process, started on first use and
# kept, since its start is paid again for every module its calls import (torch: seconds).
_worker: WorkerProcess | None = None
_worker_lock = threading.Lock()


def _call(fn: Callable[..., Any], name: str, timeout_seconds: float | None, kwargs: dict[str, Any]) -> Any:
    """`fn(**kwargs)`: directly without a limit or for an `in_process` function, else in the worker process.

    Raises:
        RewardTimeoutError: the call ran past the limit (the worker was killed).
        RewardNotSendableError: `fn` or its arguments cannot be pickled, or unpickled in the worker.
        RuntimeError: the worker process died during the call.
        Exception: whatever `fn` raised, with the worker's traceback as its cause.
    """
    global _worker
    if timeout_seconds is None or getattr(fn, "in_process", False):
        return fn(**kwargs)
    n = len(kwargs["completions"])
    with _worker_lock:
        if _worker is None or not _worker.usable:
            _worker = WorkerProcess()
        try:
            reply = _worker.call(fn, (), kwargs, timeout_seconds)
        except NotSendable as err:
            raise RewardNotSendableError(_not_sendable(name, str(err))) from err
    if reply.status == "ok":
        return reply.value
    if reply.status == "raised":
        raise reply.value
    if reply.status == "unloadable":
        raise RewardNotSendableError(_not_sendable(name, reply.value.strip().splitlines()[-1]))
    if reply.status == "timed out":
        raise RewardTimeoutError(name, n, timeout_seconds)
    raise RuntimeError(
        f"reward function {name!r}'s worker process died (exit code {reply.value}) scoring {n} completions"
    )


def _not_sendable(name: str, reason: str) -> str:
    return (
        f"reward function {name!r} cannot run in a worker process, which is how the time limit holds whatever"
        f" it does ({reason}). Define it at the top level of an importable module (not in a function or a"
        " script's `__main__`); or give it `in_process = True` if it must run in the trainer's process (it"
        " then runs without the limit); or set ExGRPOModule's `reward_timeout_seconds` to None"
    )


def _describe(value: Any) -> str:
    """A value's type and a short repr, for error messages."""
    if isinstance(value, (Tensor, np.ndarray)) and value.ndim > 0:
        return f"{type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _number(value: Any) -> float | None:
    """`value` as a float if it is a real number (Python, numpy or 0-d torch), else None."""
    if isinstance(value, Tensor):
        return float(value) if value.ndim == 0 and not value.is_complex() else None
    if isinstance(value, (np.generic, np.ndarray)):
        return float(value) if value.ndim == 0 and value.dtype.kind in "biuf" else None
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range
            return math.inf if value > 0 else -math.inf
    return None


def _scores(result: Any, name: str, completions: list[Completion]) -> Tensor:
    """Checks a reward function's return value and converts it to `[N]` float32, `nan` where it gave None.

    Raises:
        TypeError: on a return value or a score of the wrong type.
        ValueError: on the wrong number of scores, or a score that is NaN or infinite (in float32).
    """
    n = len(completions)
    expected = f"expected list[float | None] of length {n}, one score per completion"

    def where(row: int) -> str:
        return f"row {row} (completion {completion_text(completions[row])[:40]!r})"

    if isinstance(result, np.ndarray) and result.dtype == object:
        result = result.tolist()  # e.g. an array holding None: checked entry by entry below
    if isinstance(result, (Tensor, np.ndarray)):
        if result.ndim != 1 or len(result) != n:
            raise ValueError(f"reward function {name!r} returned {_describe(result)}; {expected}")
        numeric = not result.is_complex() if isinstance(result, Tensor) else result.dtype.kind in "biuf"
        if not numeric:
            raise TypeError(f"reward function {name!r} returned {_describe(result)}; {expected}")
        given = torch.as_tensor(result).detach().to("cpu", torch.float64)  # [N]
        none = torch.zeros(n, dtype=torch.bool)  # [N]
    elif isinstance(result, Sequence) and not isinstance(result, (str, bytes, bytearray)):
        if len(result) != n:
            raise ValueError(f"reward function {name!r} returned {len(result)} scores for {n} completions")
        values = []
        for row, value in enumerate(result):
            number = math.nan if value is None else _number(value)
            if number is None:
                raise TypeError(
                    f"reward function {name!r} returned {_describe(value)} for {where(row)}; {expected}"
                )
            values.append(number)
        given = torch.tensor(values, dtype=torch.float64)  # [N]
        none = torch.tensor([value is None for value in result], dtype=torch.bool)  # [N]
    else:
        raise TypeError(f"reward function {name!r} returned {_describe(result)}; {expected}")
    scores = given.float()  # [N]
    # A None is NaN by now; anything else that is not finite (including past float32's range) is an error.
    bad = ~scores.isfinite() & ~none  # [N]
    if bad.any():
        row = int(bad.nonzero()[0])
        value = float(given[row])
        reason = " (beyond float32's range)" if math.isfinite(value) else ""
        raise ValueError(
            f"reward function {name!r} returned {value}{reason} for {where(row)}; a score must be a finite "
            "number, or None where the function does not apply to the row"
        )
    return scores


def compute_rewards(
    funcs: Sequence[Callable[..., Sequence[float | None]]],
    weights: Sequence[float] | None,
    prompts: list[Prompt],
    completions: list[Completion],
    columns: Mapping[str, list[Any]],
    timeout_seconds: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scores every row with every function and sums the weighted scores.

    A `None` score becomes `nan` in that function's tensor and drops out of the weighted sum (a nansum, as
    TRL does); a row no function applies to gets a total of 0 and a warning. A function may return a list
    or tuple of floats and `None`s (numpy and 0-d torch scalars count as floats), or a 1-D numpy array or
    torch tensor of length N.

    Args:
        funcs: the reward functions, each following `RewardFunction`.
        weights: one weight per function; `None` weighs every function 1.0.
        prompts: `N` prompts: strings, or lists of chat messages.
        completions: `N` completions: strings, or, for a conversational prompt, TRL's one-message lists
            `[{"role": "assistant", "content": text}]`.
        columns: the other dataset columns, each a list of `N` values, passed to every function by name.
        timeout_seconds: the longest each function's call may take; None: no limit. A limited call runs in a
            worker process (`exgrpo_pl.rewards.worker`), killed when it runs over, so the limit holds even
            for code that keeps the GIL; SIGTERM and Ctrl-C end the wait. Functions with `in_process = True`
            are called directly, without the limit (see `RewardFunction`).

    Returns:
        `(total, per_function)`: `total` is a `[N]` float32 tensor; `per_function` maps each function's name
            (see `reward_name`) to its `[N]` float32 scores, `nan` where it returned `None`.

    Raises:
        ValueError: on no functions, a weight that is not finite, a weights/functions or column/prompt length
            mismatch, a column named like one of `REWARD_ARGUMENTS`, two functions with the same name, a bad
            `timeout_seconds`, or a function returning the wrong number of scores or a score that is NaN or
            infinite (naming the function and the row).
        TypeError: when a function returns something other than `list[float | None]` of length N (naming
            the function, what it returned and, for a bad score, the row).
        RewardTimeoutError: when a function runs past `timeout_seconds`.
        RewardNotSendableError: when a function that has to run in the worker process cannot be pickled.
    """
    if not funcs:
        raise ValueError("compute_rewards needs at least one reward function")
    if weights is None:
        weights = [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"got {len(weights)} reward weights for {len(funcs)} reward functions")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward weights must be finite numbers, got {list(weights)}")
    if timeout_seconds is not None and (
        isinstance(timeout_seconds, bool) or not 0 < timeout_seconds < math.inf
    ):
        raise ValueError(f"timeout_seconds must be a positive number or None, got {timeout_seconds!r}")
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"got {len(completions)} completions for {n} prompts")
    for key, values in columns.items():
        if key in REWARD_ARGUMENTS:
            raise ValueError(
                f"column {key!r} has the name of an argument reward functions get from the trainer"
                f" ({', '.join(REWARD_ARGUMENTS)}), which it would replace; rename the column"
            )
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} prompts")

    per_function: dict[str, Tensor] = {}
    for fn in funcs:
        name = reward_name(fn)
        if name in per_function:
            raise ValueError(f"two reward functions are named {name!r}; give them distinct `name` attributes")
        kwargs = {"prompts": prompts, "completions": completions, **columns}
        per_function[name] = _scores(_call(fn, name, timeout_seconds, kwargs), name, completions)

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

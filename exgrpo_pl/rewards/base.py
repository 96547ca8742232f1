"""The reward-function protocol and the code that turns several reward functions into one reward per row.

The protocol is TRL's, so a TRL reward function drops in unchanged: it is called with the prompts, the
completions, their token ids, the run's progress, two logging functions and every other dataset column as a
keyword list of the same length (`exgrpo_pl.rewards.protocol` lists them), may be `async def`, and returns
one float per row, or `None` where it does not apply to that row. As in TRL, a prompt is text or a list of
chat messages (conversational), and a conversational prompt's completion is a list of one message,
`[{"role": "assistant", "content": text}]`; `completion_text` gives the text of either kind, and the
shipped rewards take both. `compute_rewards` checks what each function returns (a NaN, an infinite score
or a wrong type is an error naming the function and the row) and can put a time limit on each call, which
holds whatever the function does: the call runs in a worker process that is killed when it runs over. Core
module: no Lightning.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from exgrpo_pl.rewards import limit
from exgrpo_pl.rewards.protocol import REWARD_KEYWORDS, RewardLog, is_async

Messages = list[dict[str, str]]
"""Chat messages, TRL's conversational format: `[{"role": "user", "content": "What is 1+1?"}, ...]`."""
Prompt = str | Messages
"""A prompt: text, or chat messages."""
Completion = str | Messages
"""A completion as reward functions receive it: text, or (for a conversational prompt) one assistant
message."""


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

    Dataset columns other than the prompt (e.g. `answer`, `domain`) arrive as keyword lists of length N, as
    do `completion_ids`; `trainer_state`, `log_extra` and `log_metric` come too (`REWARD_KEYWORDS`), so an
    implementation takes what it needs by name and swallows the rest with `**columns`. It may be `async
    def`: the async functions of a call are awaited concurrently.

    Under a time limit `compute_rewards` runs it in a worker process: it is sent there with cloudpickle (by
    reference when its module can be imported there, else by value, a script's own function included), and
    what it changes in itself stays there. An optional attribute `in_process = True` has it called in the
    caller's process instead, without the limit: for functions that cannot run long (the shipped
    linear-time verifiers), or that must run here (a model on the GPU, state the run reads).
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
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: Any = None,
    log: RewardLog | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scores every row with every function and sums the weighted scores.

    Each function is called as TRL's GRPOTrainer calls it (see `exgrpo_pl.rewards.protocol`): with
    `prompts`, `completions`, `completion_ids` and `trainer_state` (where given), `log_extra` and
    `log_metric`, and every column by name. The `async def` functions are awaited concurrently, after the
    others. A `None` score becomes `nan` in that function's tensor and drops out of the weighted sum (a
    nansum, as TRL does); a row no function applies to gets a total of 0 and a warning. A function may
    return a list or tuple of floats and `None`s (numpy and 0-d torch scalars count as floats), or a 1-D
    numpy array or torch tensor of length N.

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
            are called directly, without the limit (see `RewardFunction`). The async functions share one
            call there, each cancelled at the limit.
        completion_ids: `N` lists of each completion's token ids, without padding (TRL's `completion_ids`);
            None: not passed.
        trainer_state: the run's progress, passed as `trainer_state` (TRL passes its `TrainerState`:
            `global_step`, `epoch`, `max_steps`, ...); None: not passed.
        log: where the functions' `log_metric` and `log_extra` calls go, from the worker process too; None:
            they are dropped.

    Returns:
        `(total, per_function)`: `total` is a `[N]` float32 tensor; `per_function` maps each function's name
            (see `reward_name`) to its `[N]` float32 scores, `nan` where it returned `None`.

    Raises:
        ValueError: on no functions, a weight that is not finite, a weights/functions or column/prompt length
            mismatch, a column named as one of the library's keywords (`REWARD_KEYWORDS`), two functions
            with the same name, a bad `timeout_seconds`, or a function returning the wrong number of scores
            or a score that is NaN or infinite (naming the function and the row).
        TypeError: when a function returns something other than `list[float | None]` of length N (naming
            the function, what it returned and, for a bad score, the row).
        RewardTimeoutError: when a function runs past `timeout_seconds`.
        RewardNotSendableError: when a function that has to run in the worker process cannot get there.
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
    per_row = {"completion_ids": completion_ids} if completion_ids is not None else {}
    for key, values in {**per_row, **columns}.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} prompts")
        if key in REWARD_KEYWORDS and key in columns:
            raise ValueError(
                f"column {key!r} has the name of an argument reward functions get from the trainer"
                f" ({', '.join(REWARD_KEYWORDS)}), which it would replace; rename the column"
            )
    named = [(reward_name(fn), fn) for fn in funcs]
    for i, (name, _) in enumerate(named):
        if any(name == other for other, _ in named[:i]):
            raise ValueError(f"two reward functions are named {name!r}; give them distinct `name` attributes")

    kwargs: dict[str, Any] = {"prompts": prompts, "completions": completions, **per_row, **columns}
    if trainer_state is not None:
        kwargs["trainer_state"] = trainer_state
    log = RewardLog() if log is None else log
    awaited = [(name, fn) for name, fn in named if is_async(fn)]
    called = [(name, fn) for name, fn in named if not is_async(fn)]
    results = {name: limit.call(fn, name, timeout_seconds, kwargs, log) for name, fn in called}
    results.update(limit.gather(awaited, timeout_seconds, kwargs, log))
    per_function = {name: _scores(results[name], name, completions) for name, _ in named}

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


def _sent_by_value(fn: Callable[..., Any]) -> bool:
    """Whether cloudpickle sends `fn` to the worker by value: a function or a class instance defined in the
    script that runs (`__main__`) or inside a function, which no other process can import."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    owner = getattr(owner, "__func__", owner)
    return owner.__module__ == "__main__" or "<locals>" in owner.__qualname__


def check_rewards(funcs: Sequence[Callable[..., Any]], timeout_seconds: float | None) -> None:
    """Checks, before any scoring, that each reward function can run where `compute_rewards` will run it.

    A function that runs in the worker process (see `limit.runs_in_worker`) is sent there and loaded, which
    imports its module there (and starts the worker, kept for the run's calls); one that cannot get there
    (unpicklable, or its module cannot be imported there) is an error now rather than at the first step.

    Args:
        funcs: the reward functions.
        timeout_seconds: `compute_rewards`' limit.

    Raises:
        TypeError: on a reward function that is not callable.
        RewardNotSendableError: naming the function that cannot reach the worker process, and why.
    """
    for fn in funcs:
        name = reward_name(fn) if callable(fn) else repr(fn)
        if not callable(fn):
            raise TypeError(f"reward function {name} is not callable")
        if limit.runs_in_worker(fn, timeout_seconds):
            limit.check_loadable(fn, name)
            if _sent_by_value(fn):
                warnings.warn(
                    f"reward function {name!r} is defined in your script (or inside a function), and under "
                    f"reward_timeout_seconds={timeout_seconds} it runs in the worker process, sent there by "
                    "value at each call: state it keeps (a global list it appends to, its attributes) "
                    "changes there and is never seen in this process. To keep state here, give it "
                    "`in_process = True` (it then runs here, without the time limit), or define it in a "
                    "module the worker imports and read the state from a file",
                    stacklevel=2,
                )

"""How a reward function is called: the keyword arguments the library passes, and the calls themselves.

The protocol is TRL's GRPOTrainer's (`_calculate_rewards`): every function gets `prompts`, `completions`,
`completion_ids` (each completion's token ids, without padding), `trainer_state` (the run's progress:
`global_step`, `epoch`, `max_steps`, ...), `log_extra(column, values)` and `log_metric(name, value)`, and
every dataset column by name; an `async def` function is awaited, concurrently with the step's other async
functions. `compute_rewards` calls these functions in the trainer's process, or in the time-limited worker
process, where the logging calls are recorded and sent back with the scores.

Standard library only: the worker process loads this file by path (`WorkerProcess.call` with a `(path,
name)` pair), without importing the package around it (whose `__init__` imports torch, seconds at every
start).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import pickle
import threading
import traceback
from collections.abc import Callable
from typing import Any

REWARD_KEYWORDS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
)
"""The keyword arguments the library passes to every reward function, besides the dataset columns: a
dataset column must not have one of these names."""


class RewardLog:
    """What reward functions logged during one scoring call, through `log_metric` and `log_extra`.

    Attributes:
        metrics: metric name -> the values logged for it, in order (TRL averages them per step).
        extra: column name -> the per-completion values logged for it (TRL's extra columns of its
            completions table), in order.
    """

    def __init__(self) -> None:
        self.metrics: dict[str, list[float]] = {}
        self.extra: dict[str, list[Any]] = {}

    def log_metric(self, name: str, value: float) -> None:
        """Records a scalar metric of this batch (TRL's `log_metric`)."""
        self.metrics.setdefault(name, []).append(value)

    def log_extra(self, column: str, values: list[Any]) -> None:
        """Records values of a column of extra per-completion information (TRL's `log_extra`)."""
        self.extra.setdefault(column, []).extend(values)

    def merge(self, metrics: dict[str, list[float]], extra: dict[str, list[Any]]) -> None:
        """Adds what another log recorded (the worker process's, sent back with the scores)."""
        for name, values in metrics.items():
            self.metrics.setdefault(name, []).extend(values)
        for column, values in extra.items():
            self.extra.setdefault(column, []).extend(values)

    def means(self) -> dict[str, float]:
        """Each metric's mean over the values logged for it (TRL's per-step average)."""
        return {name: sum(map(float, values)) / len(values) for name, values in self.metrics.items()}


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling `fn` returns a coroutine: an `async def` function, a `functools.partial` of one, or an
    object whose `__call__` is one (TRL's `is_async_callable`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def call(fn: Callable[..., Any], kwargs: dict[str, Any], log: RewardLog | None = None) -> tuple:
    """`fn(**kwargs)` with `log_extra` and `log_metric` bound to `log` (a new one when None).

    Returns:
        `(scores, metrics, extra)`: what `fn` returned and what it logged, as plain containers that can
            travel back from the worker process.
    """
    log = RewardLog() if log is None else log
    scores = fn(**kwargs, log_extra=log.log_extra, log_metric=log.log_metric)
    return scores, log.metrics, log.extra


def gather(
    functions: list[tuple[str, Callable[..., Any]]],
    kwargs: dict[str, Any],
    timeout: float | None,
    log: RewardLog | None = None,
) -> tuple:
    """Awaits the async functions concurrently, each given at most `timeout` seconds (None: no limit).

    They run on an event loop of their own in a new thread, so a caller that is itself inside a running loop
    (a notebook) can wait for them. A function past the limit is cancelled, which stops one that awaits; one
    that blocks its loop is stopped by the worker process's hard limit instead.

    Args:
        functions: `(name, function)` pairs.
        kwargs: the keyword arguments of every call, without the logging ones (bound to `log` here).
        timeout: the limit.
        log: where the logging calls go; None: a new log.

    Returns:
        `(outcomes, metrics, extra)`: per function, in order, `("ok", scores)`, `("raised", (exception or
            None where it cannot be pickled, traceback text))` or `("timed out", None)`; and what they logged.
    """
    log = RewardLog() if log is None else log
    outcomes: list[tuple[str, Any]] = []

    async def one(fn: Callable[..., Any]) -> Any:  # a call's own error (a wrong keyword) is its task's
        return await fn(**kwargs, log_extra=log.log_extra, log_metric=log.log_metric)

    async def run_all() -> None:
        tasks = [asyncio.ensure_future(one(fn)) for _, fn in functions]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in tasks:
            if task in pending:
                outcomes.append(("timed out", None))
            elif task.exception() is not None:
                error = task.exception()
                text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
                outcomes.append(("raised", (_picklable(error), text)))
            else:
                outcomes.append(("ok", task.result()))

    thread = threading.Thread(target=asyncio.run, args=(run_all(),), name="async-rewards")
    thread.start()
    thread.join()
    if len(outcomes) != len(functions):
        raise RuntimeError("the event loop of the async reward functions stopped before they finished")
    return outcomes, log.metrics, log.extra


def loadable(fn: Callable[..., Any]) -> bool:
    """Whether `fn`, having reached this process, is callable: a setup check that it can run here."""
    return callable(fn)


def _picklable(err: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:
        return None
    return err

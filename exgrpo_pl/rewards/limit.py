"""Where each reward function runs, and the time limit that holds whatever it does.

Under a limit `compute_rewards` runs a function in a worker process (`exgrpo_pl.rewards.worker`), one per
trainer process, killed when a call runs over; a function with `in_process = True`, or any without a limit,
is called here. A call of either kind goes through `exgrpo_pl.rewards.protocol`, which binds TRL's
logging keywords and awaits the async functions together. Core module: no Lightning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exgrpo_pl.rewards import protocol
from exgrpo_pl.rewards.protocol import RewardLog
from exgrpo_pl.rewards.worker import STARTUP_SECONDS, NotSendable, WorkerProcess, remote_error


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
# The file of the calls (`protocol.call`, `protocol.gather`) the worker process makes, loaded there by path.
_PROTOCOL = str(Path(protocol.__file__))
# How long past the limit the worker's answer may take when its async functions stopped themselves at the
# limit (each is cancelled there, so it can be named); past this the worker is killed.
_ASYNC_REPLY_SECONDS = 5.0


def runs_in_worker(fn: Callable[..., Any], timeout_seconds: float | None) -> bool:
    """Whether `compute_rewards` calls `fn` in the worker process: under a limit, unless `in_process`."""
    return timeout_seconds is not None and not getattr(fn, "in_process", False)


def in_worker(
    function: Any, args: tuple, timeout: float, names: list[str], n: int, grace: float = 0.0
) -> Any:
    """`function(*args)` in the worker process (started if need be), waited for at most `timeout` (plus
    `grace`) seconds; `names` are the reward functions it calls, `n` the completions they score (for the
    messages).

    Raises:
        RewardNotSendableError: the call cannot be pickled here, or unpickled there.
        RewardTimeoutError: the call ran past `timeout` (the worker was killed); names every function.
        RuntimeError: the worker process died during the call.
        Exception: whatever the call raised, with the worker's traceback as its cause.
    """
    global _worker
    name = " / ".join(names)
    with _worker_lock:
        if _worker is None or not _worker.usable:
            _worker = WorkerProcess()
        try:
            reply = _worker.call(function, args, None, timeout + grace)
        except NotSendable as err:
            raise RewardNotSendableError(_not_sendable(name, str(err))) from err
    if reply.status == "ok":
        return reply.value
    if reply.status == "raised":
        raise reply.value
    if reply.status == "unloadable":
        raise RewardNotSendableError(_not_sendable(name, reply.value.strip().splitlines()[-1]))
    if reply.status == "timed out":
        raise RewardTimeoutError(name, n, timeout)
    raise RuntimeError(
        f"reward function {name!r}'s worker process died (exit code {reply.value}) scoring {n} completions"
    )


def call(
    fn: Callable[..., Any], name: str, timeout_seconds: float | None, kwargs: dict[str, Any], log: RewardLog
) -> Any:
    """`fn(**kwargs)`, its logging calls going to `log`: directly without a limit or for an `in_process`
    function, else in the worker process (see `in_worker` for the errors)."""
    if not runs_in_worker(fn, timeout_seconds):
        return protocol.call(fn, kwargs, log)[0]
    n = len(kwargs["completions"])
    scores, metrics, extra = in_worker((_PROTOCOL, "call"), (fn, kwargs), timeout_seconds, [name], n)
    log.merge(metrics, extra)
    return scores


def gather(
    named: list[tuple[str, Callable[..., Any]]],
    timeout_seconds: float | None,
    kwargs: dict[str, Any],
    log: RewardLog,
) -> dict[str, Any]:
    """The async functions' scores by name: awaited concurrently, those that run in the worker process there
    under the limit, the others here (see `protocol.gather`).

    Raises:
        RewardTimeoutError: naming the first function past the limit (every limited one when the worker had
            to be killed).
        Exception: whatever a function raised (the first in order), and see `in_worker`.
    """
    scores: dict[str, Any] = {}
    here = [(name, fn) for name, fn in named if not runs_in_worker(fn, timeout_seconds)]
    there = [(name, fn) for name, fn in named if runs_in_worker(fn, timeout_seconds)]
    for group, limit in ((here, None), (there, timeout_seconds)):
        if not group:
            continue
        if limit is None:
            outcomes, _, _ = protocol.gather(group, kwargs, None, log)
        else:
            names, n = [name for name, _ in group], len(kwargs["completions"])
            outcomes, metrics, extra = in_worker(
                (_PROTOCOL, "gather"), (group, kwargs, limit), limit, names, n, _ASYNC_REPLY_SECONDS
            )
            log.merge(metrics, extra)
        for (name, _), (status, value) in zip(group, outcomes):
            if status == "timed out":
                with _worker_lock:
                    _worker.stop()  # the cancelled call may hold what it had opened: start afresh
                raise RewardTimeoutError(name, len(kwargs["completions"]), limit)
            if status == "raised":
                raise remote_error(*value)
            scores[name] = value
    return scores


def _not_sendable(name: str, reason: str) -> str:
    return (
        f"reward function {name!r} cannot run in a worker process, which is how the time limit holds whatever"
        f" it does ({reason}). It is sent there with cloudpickle: by reference when its module can be"
        " imported there (that module must be importable from the trainer's sys.path), by value otherwise (a"
        " script's or a function's own), with what it holds; what cannot be pickled (a lock, an open file or"
        " connection, a model on the GPU) cannot go. Create such things inside the function; or give it"
        " `in_process = True` if it must run in the trainer's process (it then runs without the limit); or"
        " set ExGRPOModule's `reward_timeout_seconds` to None"
    )


def check_loadable(fn: Callable[..., Any], name: str) -> None:
    """Sends `fn` to the worker process and loads it there (starting the worker, kept for the run's calls).

    Raises:
        RewardNotSendableError: naming `name`, when it cannot be pickled here or loaded there.
    """
    in_worker((_PROTOCOL, "loadable"), (fn,), STARTUP_SECONDS, [name], 0)

"""A worker process that runs one call at a time under a time limit, and is killed when a call runs over.

A thread cannot enforce a time limit: Python cannot stop one, and code that keeps the GIL (a backtracking
regular expression, any long call into C) stops every other thread too, the one keeping time included.
A signal cannot either: its handler runs only between bytecodes, and only in the main thread. Killing a
process works whatever the call does. `compute_rewards` runs reward functions in one (shared by the
process), `MathVerifyReward` each answer in its own.

The worker is a plain subprocess running `_worker_main.py`, not a `multiprocessing` one: "spawn" and
"forkserver" children import the parent's `__main__` again (under the `exgrpo` CLI that is Lightning and
transformers, seconds at every start, and a script without an `if __name__ == "__main__":` guard would start
training again inside the worker), and "fork" is unsafe once torch holds threads and CUDA. It starts in tens
of milliseconds; a call's first use of a module imports it there. Linux and macOS: the worker inherits its end
of a socket pair. A SIGTERM that arrives while the main thread waits on a call ends the wait: the worker is
killed and `Terminated` raised (after the handler that was installed runs, e.g. Lightning's), and Ctrl-C
does the same with KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import cloudpickle

_SCRIPT = str(Path(__file__).with_name("_worker_main.py"))
# Starting an interpreter takes tens of milliseconds, far more on a loaded machine.
STARTUP_SECONDS = 120.0


class Terminated(SystemExit):
    """SIGTERM arrived while this process waited on a worker process's call; the worker was killed."""


class NotSendable(TypeError):
    """A call could not be pickled for the worker process; nothing was sent."""


class RemoteTraceback(Exception):
    """The traceback, printed in the worker process, of an exception a call raised there."""


def remote_error(error: BaseException | None, text: str) -> BaseException:
    """An exception raised in the worker process, with its traceback there (`text`) as its cause; a
    RuntimeError carrying the traceback's last line when the exception itself could not be pickled (None)."""
    error = error if error is not None else RuntimeError(text.strip().splitlines()[-1])
    error.__cause__ = RemoteTraceback(f"\n\n{text}")
    return error


@dataclass(frozen=True)
class Reply:
    """What became of a call.

    Attributes:
        status: "ok" (`value` is the return value), "raised" (`value` is the exception, its cause a
            `RemoteTraceback`), "unloadable" (the call could not be unpickled in the worker: `value` is the
            traceback), "timed out" or "died" (`value` is the worker's exit code); after the last two the
            worker is stopped.
        value: see `status`.
    """

    status: str
    value: Any = None


def _stop(process: subprocess.Popen, connection: Connection, owner: int) -> None:
    if os.getpid() != owner:
        return  # a copy inherited through fork: the worker belongs to the parent process
    connection.close()
    process.kill()  # a no-op when it has already exited
    process.wait()  # reaps it: no zombie


@contextlib.contextmanager
def _sigterm_ends_the_wait():
    """In the main thread, a SIGTERM raises `Terminated` after running the handler that was installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def handler(signum, frame):
        if callable(previous):
            previous(signum, frame)
        raise Terminated(f"stopped by signal {signum} while waiting on a worker process")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class WorkerProcess:
    """A started worker process and this process's end of its connection; `stop()` or collection kills it.

    Args:
        warmup: a call `(function, args)` made before the worker counts as started, outside any call's
            limit (e.g. imports a library once).

    Raises:
        RuntimeError: when the worker exits or stays silent before it is ready, or the warm-up fails.
    """

    def __init__(self, warmup: tuple[Any, tuple] | None = None) -> None:
        connection, child_end = multiprocessing.Pipe()
        with child_end:
            fd = child_end.fileno()
            self.process = subprocess.Popen(
                [sys.executable, "-I", _SCRIPT, str(fd), str(os.getpid())],
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
            )
        self.connection = connection
        self.owner = os.getpid()
        self._finalizer = weakref.finalize(self, _stop, self.process, connection, self.owner)
        try:
            connection.send(sys.path)
            ready = connection.poll(STARTUP_SECONDS) and connection.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            raise RuntimeError(
                f"a worker process did not start (exit code {self.stop(grace=1.0)}); its error, if any, is"
                " printed above"
            )
        if warmup is not None:
            reply = self.call(*warmup, timeout=STARTUP_SECONDS)
            if reply.status != "ok":
                self.stop()
                raise RuntimeError(f"a worker process's warm-up call {reply.status}: {reply.value}") from (
                    reply.value if isinstance(reply.value, BaseException) else None
                )

    @property
    def usable(self) -> bool:
        """Whether this process may send it calls: it runs, and was started by this process (not a fork)."""
        return self.owner == os.getpid() and self.process.poll() is None

    def call(self, function: Any, args: tuple = (), kwargs: dict | None = None, timeout: float | None = None):
        """`function(*args, **kwargs)` in the worker, waited for at most `timeout` seconds (None: no limit).

        Args:
            function: a callable cloudpickle can send (a module's function or class instance goes by
                reference, and its module is imported there; a `__main__` or local function goes by value),
                or a `(path, name)` pair naming a function of a stdlib-only file.
            args: its positional arguments, sent the same way.
            kwargs: its keyword arguments, sent the same way.
            timeout: the limit; a call that runs over kills the worker.

        Returns:
            A `Reply`.

        Raises:
            NotSendable: when the call cannot be pickled (nothing was sent).
            Terminated, KeyboardInterrupt: on SIGTERM or Ctrl-C during the wait (the worker is killed).
        """
        try:
            # cloudpickle sends what plain pickle sends by reference (a module's function) the same way, and
            # by value what no other process could import: a script's `__main__` function, a local function.
            message = cloudpickle.dumps((function, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # PicklingError, or TypeError for a lock, a generator, a CUDA stream
            raise NotSendable(f"{type(err).__name__}: {err}") from err
        connection = self.connection
        try:
            with _sigterm_ends_the_wait():
                connection.send_bytes(message)
                if not connection.poll(timeout):
                    return Reply("timed out", self.stop())
                status, value = connection.recv()
        except (EOFError, OSError):
            # A worker that died has closed its connection and is exiting: wait for its own exit code.
            return Reply("died", self.stop(grace=1.0))
        except BaseException:
            self.stop()  # interrupted while the worker had the call: it could still answer later
            raise
        if status == "raised":
            value = remote_error(*value)
        return Reply(status, value)

    def stop(self, grace: float = 0.0) -> int | None:
        """Kills the worker, after up to `grace` seconds for one that is exiting to do so; its exit code."""
        if grace:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
        self._finalizer()
        return self.process.returncode

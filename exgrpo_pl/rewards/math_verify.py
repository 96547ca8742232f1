"""Math verifier: compares the last `\\boxed{...}` answer with the reference using HuggingFace math-verify.

Needs the optional extra: `pip install 'exgrpo-pl[math]'`.

Time limit: each row is parsed and verified in a worker process, which is killed when a row runs over the
limit. A signal (the SIGALRM timer used before) cannot always enforce it: Python runs a signal handler only
between bytecodes, so it waits for a call into C code that does not check for signals to return, and
signals only reach the main thread, so from any other thread the timer limited nothing. Killing a process
works in every case, and a worker that crashes cannot take the trainer down. math-verify's own timeouts are
off: they use `signal.alarm` with whole seconds and turn a timeout into an ordinary "wrong" without saying so.

The worker is started on the first row and serves the later ones (a round trip adds about 0.1 ms a row);
after a timeout or a crash the next row starts a new one (about a second: a fresh interpreter importing
math-verify and SymPy). Each process, so each DDP rank, has its own. It is a plain subprocess running
`_math_verify_worker.py`, not a `multiprocessing` one: "spawn" and "forkserver" children import the
parent's `__main__` again (under the `exgrpo` CLI that is Lightning and transformers, seconds at every start,
and a script without an `if __name__ == "__main__":` guard would start training again inside the worker),
and "fork" is unsafe once torch holds threads and CUDA. POSIX only: the worker inherits its end of a socket
pair.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import warnings
import weakref
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from exgrpo_pl.rewards._math_verify_worker import check
from exgrpo_pl.rewards.base import AnswerReward
from exgrpo_pl.validation import check_number

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
_WORKER_SCRIPT = str(Path(__file__).with_name("_math_verify_worker.py"))
# A fresh interpreter importing SymPy: about a second, far more on a loaded machine.
_STARTUP_SECONDS = 120.0
# What `score` got instead of a reply from the worker (a reply is a tuple).
_TIMED_OUT, _DIED = "timed out", "died"


def extract_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` in `text`, braces balanced.

    Escaped braces (`\\{`, `\\}`) do not count. A box nested in another box is the later one, so
    `\\boxed{\\boxed{3}}` gives "3".

    Args:
        text: a completion or reference answer.

    Returns:
        The contents (possibly empty), or None when there is no box or the last one is never closed (a
        truncated generation: its answer is incomplete, and an earlier box is not the final answer).
    """
    opens = [m.end() for m in _BOXED_OPEN.finditer(text)]
    if not opens:
        return None
    start = opens[-1]
    depth = 1
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped character
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _stop(process: subprocess.Popen, connection: Connection, owner: int) -> None:
    if os.getpid() != owner:
        return  # a copy inherited through fork: the worker belongs to the parent process
    connection.close()
    process.kill()  # a no-op when it has already exited
    process.wait()  # reaps it: no zombie


class _Worker:
    """A started worker process and this process's end of its connection; `stop()` or collection kills it.

    Raises:
        RuntimeError: when the worker exits or stays silent before it is ready.
    """

    def __init__(self) -> None:
        connection, child_end = multiprocessing.Pipe()
        with child_end:
            fd = child_end.fileno()
            self.process = subprocess.Popen(
                [sys.executable, "-I", _WORKER_SCRIPT, str(fd)], pass_fds=(fd,), stdin=subprocess.DEVNULL
            )
        self.connection = connection
        self.owner = os.getpid()
        self._finalizer = weakref.finalize(self, _stop, self.process, connection, self.owner)
        try:
            connection.send(sys.path)
            ready = connection.poll(_STARTUP_SECONDS) and connection.recv() == "ready"
        except (EOFError, OSError):
            ready = False
        if not ready:
            raise RuntimeError(
                f"math-verify's worker process did not start (exit code {self.stop(grace=1.0)}); "
                "its error, if any, is printed above"
            )

    def stop(self, grace: float = 0.0) -> int | None:
        """Kills the worker, after up to `grace` seconds for one that is exiting to do so; its exit code."""
        if grace:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace)
        self._finalizer()
        return self.process.returncode


class MathVerifyReward(AnswerReward):
    """1.0 when the completion's final answer is mathematically equal to the `answer` column, else 0.0.

    The prediction is the last `\\boxed{...}` of the completion, or the whole completion when it has none;
    a reference wrapped in `\\boxed{}` is unwrapped the same way. Rows are checked in a worker process (see
    the module docstring); copies and unpickled copies start their own.

    Args:
        timeout_seconds: time limit for parsing and verifying one row; a row that runs over, or whose worker
            process dies, scores 0.0 with a warning. `None` disables the limit: rows are then checked in
            this process, with no worker.
        name: the name its scores are logged under.

    Raises:
        ImportError: if math-verify is not installed.
    """

    def __init__(self, timeout_seconds: float | None = 5.0, name: str = "math_verify") -> None:
        try:
            import math_verify  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "MathVerifyReward needs the math-verify package: pip install 'exgrpo-pl[math]'"
            ) from err
        check_number("MathVerifyReward", "timeout_seconds", timeout_seconds, 0, low_open=True, optional=True)
        self.timeout_seconds = timeout_seconds
        self.name = name
        self._worker: _Worker | None = None
        self._lock = threading.Lock()  # one row at a time on the worker's connection

    def __getstate__(self) -> dict[str, Any]:
        # The worker process stays with this object: a copy starts its own on first use.
        state = {**self.__dict__, "_worker": None}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stops the worker process now instead of when this object is collected; a later call starts one."""
        with self._lock:
            self._discard_worker()

    def score(self, completion: str, answer: Any, row: int) -> float:
        reference = str(answer)
        predicted = extract_boxed(completion)
        prediction = completion if predicted is None else f"\\boxed{{{predicted}}}"
        gold = extract_boxed(reference)
        gold = f"\\boxed{{{reference if gold is None else gold}}}"
        if self.timeout_seconds is None:
            return check(prediction, gold)
        with self._lock:
            worker = self._live_worker()
            try:
                connection = worker.connection
                connection.send((prediction, gold))
                reply = connection.recv() if connection.poll(self.timeout_seconds) else _TIMED_OUT
            except (EOFError, OSError):
                reply = _DIED
            except BaseException:
                # Interrupted while the worker had the row: it could still answer later, so it is not reused.
                self._discard_worker()
                raise
            if reply in (_TIMED_OUT, _DIED):
                # A worker that died has closed its connection and is exiting: wait for its own exit code.
                exit_code = self._discard_worker(grace=1.0 if reply == _DIED else 0.0)
        if reply == _TIMED_OUT:
            warnings.warn(
                f"math-verify ran over {self.timeout_seconds}s on answer {reference[:200]!r}; scored 0.0",
                stacklevel=3,
            )
            return 0.0
        if reply == _DIED:
            warnings.warn(
                f"math-verify's worker process died (exit code {exit_code}) on answer "
                f"{reference[:200]!r}; scored 0.0",
                stacklevel=3,
            )
            return 0.0
        ok, value = reply
        if not ok:
            raise RuntimeError(f"math-verify failed on row {row} (answer {reference[:200]!r}):\n{value}")
        return value

    def _live_worker(self) -> _Worker:
        worker = self._worker
        if worker is not None and worker.owner != os.getpid():
            worker = None  # inherited through fork: it serves the parent process
        elif worker is not None and worker.process.poll() is not None:
            warnings.warn(
                f"math-verify's worker process exited between rows (exit code {worker.process.returncode});"
                " starting a new one",
                stacklevel=4,
            )
            worker.stop()
            worker = None
        if worker is None:
            worker = _Worker()
        self._worker = worker
        return worker

    def _discard_worker(self, grace: float = 0.0) -> int | None:
        worker, self._worker = self._worker, None
        return None if worker is None else worker.stop(grace)

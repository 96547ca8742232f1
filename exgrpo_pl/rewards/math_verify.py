"""Math verifier: compares the last `\\boxed{...}` answer with the reference using HuggingFace math-verify.

Needs the optional extra: `pip install 'exgrpo-pl[math]'`.

Time limit: each row is parsed and verified in a worker process (`exgrpo_pl.rewards.worker`), which is
killed when a row runs over the limit. A signal (the SIGALRM timer used before) cannot always enforce it:
Python runs a signal handler only between bytecodes, so it waits for a call into C code that does not check
for signals to return, and signals only reach the main thread, so from any other thread the timer limited
nothing. Killing a process works in every case, and a worker that crashes cannot take the trainer down.
math-verify's own timeouts are off: they use `signal.alarm` with whole seconds and turn a timeout into an
ordinary "wrong" without saying so.

The worker is started on the first row and serves the later ones (a round trip adds about 0.1 ms a row);
after a timeout or a crash the next row starts a new one (about a second: a fresh interpreter importing
math-verify and SymPy). Each reward object, so each DDP rank, has its own. The worker loads
`_math_verify_check.py` by its path, so it never imports torch.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any

from exgrpo_pl.rewards._math_verify_check import check
from exgrpo_pl.rewards.base import AnswerReward
from exgrpo_pl.rewards.worker import WorkerProcess
from exgrpo_pl.validation import check_number

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
# The check as the worker loads it: by the file's path (see `_math_verify_check.py`).
_CHECK_FILE = str(Path(__file__).with_name("_math_verify_check.py"))
_CHECK, _WARM_UP = (_CHECK_FILE, "check"), (_CHECK_FILE, "warm_up")


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


class MathVerifyReward(AnswerReward):
    """1.0 when the completion's final answer is mathematically equal to the `answer` column, else 0.0.

    The prediction is the last `\\boxed{...}` of the completion (of its text, for a conversational one), or
    the whole completion when it has none; a reference wrapped in `\\boxed{}` is unwrapped the same way.
    Rows are checked in a worker process (see the module docstring); copies and unpickled copies start their
    own.

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
        self._worker: WorkerProcess | None = None
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

    @property
    def in_process(self) -> bool:
        """With its own per-row limit it bounds itself, so `compute_rewards` calls it directly (its batch
        limit then does not apply: a batch takes at most rows x `timeout_seconds`, plus restarts); without
        one it checks rows in the caller, so `compute_rewards` runs it in a worker process under its limit."""
        return self.timeout_seconds is not None

    def extract_answer(self, completion: str) -> str | None:
        """The content of the completion's last `\\boxed{...}`, whitespace removed (the answer majority
        voting compares, as text: two forms of one value vote apart), or None."""
        boxed = extract_boxed(completion)
        return None if boxed is None else "".join(boxed.split())

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
                reply = worker.call(_CHECK, (prediction, gold), timeout=self.timeout_seconds)
            finally:
                if not worker.usable:
                    self._worker = None  # timed out, died or interrupted: the next row starts a new one
        if reply.status == "timed out":
            warnings.warn(
                f"math-verify ran over {self.timeout_seconds}s on answer {reference[:200]!r}; scored 0.0",
                stacklevel=3,
            )
            return 0.0
        if reply.status == "died":
            warnings.warn(
                f"math-verify's worker process died (exit code {reply.value}) on answer "
                f"{reference[:200]!r}; scored 0.0",
                stacklevel=3,
            )
            return 0.0
        if reply.status != "ok":
            detail = reply.value.__cause__ if reply.status == "raised" else reply.value
            raise RuntimeError(f"math-verify failed on row {row} (answer {reference[:200]!r}):{detail}")
        return reply.value

    def _live_worker(self) -> WorkerProcess:
        worker = self._worker
        if worker is not None and worker.owner != os.getpid():
            worker = None  # inherited through fork: it serves the parent process
        elif worker is not None and not worker.usable:
            warnings.warn(
                f"math-verify's worker process exited between rows (exit code {worker.process.returncode});"
                " starting a new one",
                stacklevel=4,
            )
            worker.stop()
            worker = None
        if worker is None:
            worker = WorkerProcess(warmup=(_WARM_UP, ()))
        self._worker = worker
        return worker

    def _discard_worker(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

"""Math verifier: compares the last `\\boxed{...}` answer with the reference using HuggingFace math-verify.

Needs the optional extra: `pip install 'exgrpo-pl[math]'`.

Time limit: math-verify's own timeouts use `signal.alarm` with whole seconds and turn a timeout into an
ordinary "wrong" without saying so, so they are switched off and one limit covers parsing and verifying each
row here instead. It is a SIGALRM interval timer, which interrupts the pure-Python SymPy work that hangs on
pathological answers. Signals only reach the main thread: called from another thread (or on a platform
without `signal.setitimer`) the rows run without a limit, with a warning.
"""

from __future__ import annotations

import re
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from exgrpo_pl.rewards.base import AnswerReward

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")


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


class _VerifyTimeout(BaseException):
    # BaseException, not Exception: math-verify and SymPy catch Exception and would swallow it.
    pass


def _alarm_available() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raises `_VerifyTimeout` in the body after `seconds`; restores any timer that was already running."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise _VerifyTimeout

    started = time.monotonic()
    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            # None: the previous handler was not installed from Python and cannot be put back from here.
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
            if previous_delay > 0:
                # The outer timer keeps its deadline; if it already passed, fire it as soon as possible.
                remaining = previous_delay - (time.monotonic() - started)
                signal.setitimer(signal.ITIMER_REAL, max(remaining, 1e-6))


class MathVerifyReward(AnswerReward):
    """1.0 when the completion's final answer is mathematically equal to the `answer` column, else 0.0.

    The prediction is the last `\\boxed{...}` of the completion, or the whole completion when it has none;
    a reference wrapped in `\\boxed{}` is unwrapped the same way.

    Args:
        timeout_seconds: time limit for parsing and verifying one row; a row that runs over scores 0.0
            with a warning. `None` disables the limit.
        name: the name its scores are logged under.

    Raises:
        ImportError: if math-verify is not installed.
    """

    def __init__(self, timeout_seconds: float | None = 5.0, name: str = "math_verify") -> None:
        try:
            import math_verify
        except ImportError as err:
            raise ImportError(
                "MathVerifyReward needs the math-verify package: pip install 'exgrpo-pl[math]'"
            ) from err
        if timeout_seconds is not None and timeout_seconds <= 0:
            raise ValueError(f"MathVerifyReward: timeout_seconds must be > 0 or None, got {timeout_seconds}")
        self._parse = math_verify.parse
        self._verify = math_verify.verify
        self.timeout_seconds = timeout_seconds
        self.name = name
        self._warned_no_limit = False

    def score(self, completion: str, answer: Any, row: int) -> float:
        reference = str(answer)
        predicted = extract_boxed(completion)
        prediction = completion if predicted is None else f"\\boxed{{{predicted}}}"
        gold = extract_boxed(reference)
        gold = f"\\boxed{{{reference if gold is None else gold}}}"
        if self.timeout_seconds is None:
            return self._check(prediction, gold)
        if not _alarm_available():
            if not self._warned_no_limit:
                warnings.warn(
                    "MathVerifyReward called off the main thread: its time limit cannot fire there",
                    stacklevel=3,
                )
                self._warned_no_limit = True
            return self._check(prediction, gold)
        try:
            with _time_limit(self.timeout_seconds):
                return self._check(prediction, gold)
        except _VerifyTimeout:
            warnings.warn(
                f"math-verify ran over {self.timeout_seconds}s on answer {reference[:200]!r}; scored 0.0",
                stacklevel=3,
            )
            return 0.0

    def _check(self, prediction: str, gold: str) -> float:
        # Their own timeouts off: see the module docstring.
        parsed_gold = self._parse(gold, parsing_timeout=None)
        parsed_prediction = self._parse(prediction, parsing_timeout=None)
        return 1.0 if self._verify(parsed_gold, parsed_prediction, timeout_seconds=None) else 0.0

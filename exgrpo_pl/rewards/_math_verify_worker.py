"""The worker process of `MathVerifyReward`, and the check it runs (see `exgrpo_pl.rewards.math_verify`).

The reward starts this file as a script, `python -I _math_verify_worker.py FD` (isolated mode keeps this
directory, which has a `math_verify.py` of its own, off `sys.path`), so a worker imports math-verify and
the standard library only, not the `exgrpo_pl` package (which imports torch, 2 s of every start): keep it so.

Protocol over the connection on file descriptor FD: the parent sends its `sys.path`; the worker imports
math-verify, checks one row to warm it up and answers "ready"; then it answers each `(prediction, gold)` it
receives with `(True, score)`, or `(False, traceback)` when math-verify raised, until the connection closes.
"""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from multiprocessing.connection import Connection


def check(prediction: str, gold: str) -> float:
    """1.0 when math-verify finds `prediction` equal to `gold` (both `\\boxed{...}` strings), else 0.0.

    math-verify's own timeouts are off: see `exgrpo_pl.rewards.math_verify`.
    """
    from math_verify import parse, verify

    parsed_gold = parse(gold, parsing_timeout=None)
    parsed_prediction = parse(prediction, parsing_timeout=None)
    return 1.0 if verify(parsed_gold, parsed_prediction, timeout_seconds=None) else 0.0


def serve(connection: Connection) -> None:
    """Answers rows until the parent closes the connection (or kills this process)."""
    # Ctrl-C goes to the whole process group: the parent handles it and stops this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.path[:] = connection.recv()
    # Warm-up: the imports and first-call setup do not count against a row's limit. Logging is off for it, so
    # math-verify's one-time notice that its timeouts are off (the parent's limit replaces them) stays quiet.
    logging.disable(logging.WARNING)
    check("\\boxed{1}", "\\boxed{1}")
    logging.disable(logging.NOTSET)
    connection.send("ready")
    while True:
        try:
            prediction, gold = connection.recv()
        except EOFError:
            return
        try:
            reply = (True, check(prediction, gold))
        except Exception:
            reply = (False, traceback.format_exc())
        connection.send(reply)


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))

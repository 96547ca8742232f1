"""The check `MathVerifyReward` runs in its worker process (see `exgrpo_pl.rewards.math_verify`).

The worker loads this file by its path, not as `exgrpo_pl.rewards._math_verify_check`, so it imports
math-verify and the standard library only, not the `exgrpo_pl` package (which imports torch, 2 s of every
start after a timeout): keep it so.
"""

from __future__ import annotations

import logging


def check(prediction: str, gold: str) -> float:
    """1.0 when math-verify finds `prediction` equal to `gold` (both `\\boxed{...}` strings), else 0.0.

    math-verify's own timeouts are off: see `exgrpo_pl.rewards.math_verify`.
    """
    from math_verify import parse, verify

    parsed_gold = parse(gold, parsing_timeout=None)
    parsed_prediction = parse(prediction, parsing_timeout=None)
    return 1.0 if verify(parsed_gold, parsed_prediction, timeout_seconds=None) else 0.0


def warm_up() -> None:
    """Imports math-verify and checks one row, so that neither counts against a row's limit.

    Logging is off meanwhile, so math-verify's one-time notice that its timeouts are off (the parent's limit
    replaces them) stays quiet.
    """
    logging.disable(logging.WARNING)
    try:
        check("\\boxed{1}", "\\boxed{1}")
    finally:
        logging.disable(logging.NOTSET)

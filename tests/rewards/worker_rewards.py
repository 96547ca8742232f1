"""Reward functions for the time-limit tests, run in the worker process: this module imports the standard
library only, so a worker that loads it starts in milliseconds."""

import re

# Exponential backtracking on "aaa...a!": `re` keeps the GIL for the whole match, which never ends.
_BACKTRACKING = re.compile(r"(a+)+$")


def ones(prompts, completions, **columns):
    return [1.0] * len(completions)


def backtracking(prompts, completions, **columns):
    return [0.0 if _BACKTRACKING.fullmatch("a" * 60 + "!") else 1.0 for _ in completions]


def missing_column(prompts, completions, **columns):
    return [float(len(c)) for c in columns["no_such_column"]]


def nan_scores(prompts, completions, **columns):
    return [float("nan")] * len(completions)


async def async_wait(prompts, completions, **columns):
    """Sleeps 1 s without blocking its loop: two of them awaited together take 1 s, not 2."""
    import asyncio

    await asyncio.sleep(1.0)
    return [2.0] * len(completions)


async def async_wait_too(prompts, completions, log_metric, **columns):
    import asyncio

    await asyncio.sleep(1.0)
    log_metric("judge_calls", len(completions))
    return [3.0] * len(completions)


async def async_forever(prompts, completions, **columns):
    import asyncio

    await asyncio.sleep(3600)


async def async_blocks_its_loop(prompts, completions, **columns):
    return backtracking(prompts, completions)


async def async_raises(prompts, completions, **columns):
    raise LookupError("the judge is down")


def state_and_ids(prompts, completions, completion_ids, trainer_state, log_extra, **columns):
    log_extra("n_ids", [len(ids) for ids in completion_ids])
    return [float(trainer_state.global_step + len(ids)) for ids in completion_ids]


async def async_ones(prompts, completions, **columns):
    return [1.0] * len(completions)

"""Reward functions written to TRL's protocol, each reading one of its keyword arguments, for the runs of
test_protocol_in_runs.py. Standard library only: the worker process that runs them starts in milliseconds."""

import asyncio


def length_reward(completions, completion_ids, **kwargs):
    """Each completion's token count, stop token included: the step's `completions/mean_length`."""
    return [float(len(ids)) for ids in completion_ids]


def progress_reward(completions, trainer_state, log_metric, **kwargs):
    """The run's progress, `global_step / max_steps`, for every row; logs the fractional epoch."""
    log_metric("progress_epoch", trainer_state.epoch)
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


async def judge_reward(completions, log_metric, log_extra, **kwargs):
    """An `async def` reward, as an LLM judge over HTTP would be: awaits, logs a metric and a column."""
    await asyncio.sleep(0.01)
    log_metric("judge_calls", 1.0)
    log_extra("judged", [True] * len(completions))
    return [0.5] * len(completions)

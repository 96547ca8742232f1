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

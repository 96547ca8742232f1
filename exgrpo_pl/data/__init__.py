"""Prompt data: the Lightning datamodule, file loading and the synthetic arithmetic and reasoning tasks.

Layer: above the shared basics (`batch`, `seeding`, `validation`) and the rewards (a boxed answer's
extraction, the reasoning task's parser), which it imports, and the engines, which it does not need; below
the replay memory, the training step, the module and the callbacks, none of which it imports.
"""

from exgrpo_pl.data.datamodule import ExcludingRandomSampler, PromptDataModule, collate_rows
from exgrpo_pl.data.eval_sets import EvalSet
from exgrpo_pl.data.loading import load_rows, split_rows
from exgrpo_pl.data.reasoning import (
    MAX_DERIVATION_LENGTH,
    REASONING_ALPHABET,
    REASONING_FAMILIES,
    REASONING_OOD_FAMILIES,
    ReasoningTask,
    write_derivation,
)
from exgrpo_pl.data.synthetic import ARITHMETIC_ALPHABET, FAMILIES, ArithmeticTask
from exgrpo_pl.data.task import SyntheticTask

__all__ = [
    "ARITHMETIC_ALPHABET",
    "FAMILIES",
    "MAX_DERIVATION_LENGTH",
    "ArithmeticTask",
    "EvalSet",
    "ExcludingRandomSampler",
    "PromptDataModule",
    "REASONING_ALPHABET",
    "REASONING_FAMILIES",
    "REASONING_OOD_FAMILIES",
    "ReasoningTask",
    "SyntheticTask",
    "collate_rows",
    "load_rows",
    "split_rows",
    "write_derivation",
]

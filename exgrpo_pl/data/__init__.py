"""Prompt data: the Lightning datamodule, file loading and the synthetic arithmetic task."""

from exgrpo_pl.data.datamodule import ExcludingRandomSampler, PromptDataModule, collate_rows
from exgrpo_pl.data.loading import load_rows, split_rows
from exgrpo_pl.data.synthetic import ARITHMETIC_ALPHABET, FAMILIES, ArithmeticTask

__all__ = [
    "ARITHMETIC_ALPHABET",
    "FAMILIES",
    "ArithmeticTask",
    "ExcludingRandomSampler",
    "PromptDataModule",
    "collate_rows",
    "load_rows",
    "split_rows",
]

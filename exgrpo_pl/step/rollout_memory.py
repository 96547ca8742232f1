"""Refuses, before training, a step whose rollouts cannot fit in the device's memory, and before any
evaluation, a validation or test batch whose samples cannot (`check_evaluation_memory`).

A training step samples `batch_size x num_generations` completions in one call, so an oversized
`num_generations` (100,000, say) is not an error anywhere else: the run allocates until the kernel kills it,
with no message. The estimate counts only what sampling must hold at once, for a row that runs to
`max_completion_length` after a one-token prompt: the KV cache (keys and values of every layer for every
token of every row) and the last position's float32 logits. The real peak (longer prompts, activations, the
training forward) is higher, so what this refuses can never fit; what it lets through may still not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from transformers import AutoConfig

from exgrpo_pl.models import DTYPES, resolve_model_path

# The model config fields the estimate reads; a config without them (not a decoder LM) is not checked.
_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")


def device_memory_bytes(device: torch.device) -> int:
    """The total memory of `device`: a GPU's own, else the machine's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sampling_bytes(config, rows: int, tokens: int, dtype: torch.dtype) -> int | None:
    """At least what sampling `rows` sequences of `tokens` tokens at once holds; None for an unknown config.

    Args:
        config: the model's transformers config.
        rows: sequences sampled together.
        tokens: the length one of them reaches (prompt and completion).
        dtype: the KV cache's dtype (the policy's).
    """
    if not all(isinstance(getattr(config, field, None), int) for field in _FIELDS):
        return None
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize  # keys and values
    return rows * tokens * per_token + rows * config.vocab_size * 4  # [rows, vocab] float32 logits


def _beyond_memory(hparams, rows: int, device: torch.device) -> str | None:
    """Why sampling `rows` completions at once cannot fit in `device`'s memory, or None (it may fit)."""
    config = AutoConfig.from_pretrained(resolve_model_path(hparams["model_name_or_path"]))
    budget = hparams["max_completion_length"]
    needed = sampling_bytes(config, rows, 1 + budget, DTYPES[hparams["dtype"]])
    available = device_memory_bytes(torch.device(device))
    if needed is None or needed <= available:
        return None
    return (
        f"whose KV cache and logits alone need {needed / 2**30:.1f} GiB at max_completion_length={budget},"
        f" more than the {available / 2**30:.1f} GiB of memory of {device}"
    )


def check_rollout_memory(hparams, batch_size: int, device: torch.device) -> None:
    """Raises ValueError naming `num_generations` when one step's sampling cannot fit in `device`'s memory.

    Args:
        hparams: ExGRPOModule's hyperparameters (model, `num_generations`, `max_completion_length`, `dtype`).
        batch_size: prompts per training batch (PromptDataModule's).
        device: where the rollouts are sampled.
    """
    k = hparams["num_generations"]
    rows = batch_size * k
    beyond = _beyond_memory(hparams, rows, device)
    if beyond is not None:
        raise ValueError(
            f"ExGRPOModule num_generations={k}: a training step samples {rows:,} completions at once (data"
            f" batch_size {batch_size} x num_generations), {beyond}. Lower num_generations, the data's"
            " batch_size or max_completion_length."
        )


def check_evaluation_memory(
    hparams,
    sets: Mapping[str | None, Sequence[int | None]],
    batch_size: int,
    ranks: int,
    device: torch.device,
) -> None:
    """Raises ValueError naming the set, its `num_samples` and `val_batch_size` when one validation or test
    batch's sampling cannot fit in `device`'s memory, as `check_rollout_memory` does for a training step.

    A batch samples all its problems' completions in one call. The count checked is the fewest a rank's
    first batch can hold: its `val_batch_size` problems (or all its share of the set, if fewer) with the
    smallest `num_samples`.

    Args:
        hparams: ExGRPOModule's hyperparameters (model, `val_num_generations`, `max_completion_length`,
            `dtype`).
        sets: set name (None for the plain validation set) -> each problem's `num_samples` (None:
            `val_num_generations`).
        batch_size: problems per validation batch (PromptDataModule's `val_batch_size`, else `batch_size`).
        ranks: processes the sets are split over.
        device: where the completions are sampled.
    """
    for name, samples in sets.items():
        counts = sorted(k or hparams["val_num_generations"] for k in samples)
        problems = min(batch_size, -(-len(counts) // ranks))
        rows = sum(counts[:problems])
        beyond = _beyond_memory(hparams, rows, device) if rows else None
        if beyond is None:
            continue
        if name is None:
            what, lower = (
                f"ExGRPOModule val_num_generations={counts[0]}: a validation batch",
                "val_num_generations",
            )
        else:
            k = str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"
            what, lower = f"eval_sets[{name!r}] num_samples={k}: a batch of the set", "the set's num_samples"
        raise ValueError(
            f"{what} samples at least {rows:,} completions at once ({problems} problem(s) a batch,"
            f" val_batch_size={batch_size}, x their samples), {beyond}. Lower {lower}, the data's"
            " val_batch_size or max_completion_length."
        )

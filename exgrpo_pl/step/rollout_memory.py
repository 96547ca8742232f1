"""Refuses, before training, a step whose rollouts cannot fit in the device's memory.

A training step samples `batch_size x num_generations` completions in one call, so an oversized
`num_generations` (100,000, say) is not an error anywhere else: the run allocates until the kernel kills it,
with no message. The estimate counts only what sampling must hold at once, for a row that runs to
`max_completion_length` after a one-token prompt: the KV cache (keys and values of every layer for every
token of every row) and the last position's float32 logits. The real peak (longer prompts, activations, the
training forward) is higher, so what this refuses can never fit; what it lets through may still not.
"""

from __future__ import annotations

import os

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


def check_rollout_memory(hparams, batch_size: int, device: torch.device) -> None:
    """Raises ValueError naming `num_generations` when one step's sampling cannot fit in `device`'s memory.

    Args:
        hparams: ExGRPOModule's hyperparameters (model, `num_generations`, `max_completion_length`, `dtype`).
        batch_size: prompts per training batch (PromptDataModule's).
        device: where the rollouts are sampled.
    """
    config = AutoConfig.from_pretrained(resolve_model_path(hparams["model_name_or_path"]))
    k, budget = hparams["num_generations"], hparams["max_completion_length"]
    rows = batch_size * k
    needed = sampling_bytes(config, rows, 1 + budget, DTYPES[hparams["dtype"]])
    available = device_memory_bytes(torch.device(device))
    if needed is not None and needed > available:
        raise ValueError(
            f"ExGRPOModule num_generations={k}: a training step samples {rows:,} completions at once (data"
            f" batch_size {batch_size} x num_generations), whose KV cache and logits alone need"
            f" {needed / 2**30:.1f} GiB at max_completion_length={budget}, more than the"
            f" {available / 2**30:.1f} GiB of memory of {device}. Lower num_generations, the data's"
            " batch_size or max_completion_length."
        )

"""Sampling completions with `model.generate`: the completions, their masks, and the positions of padded rows.

Prompts are left-padded and completions right-padded (see `exgrpo_pl.batch`). Positions are derived from
the attention mask (`position_ids_from_mask`) here in generation and in scoring (`exgrpo_pl.step.rollout`), so
the log-probs of a scored completion are exactly the ones it was sampled with.

Layer: part of the rollout engines (`exgrpo_pl.engines.hf` samples with `sample_completions`,
`exgrpo_pl.engines.static` positions its rows with `position_ids_from_mask`). It imports nothing else of
exgrpo_pl, so the training step imports it and never the reverse. No Lightning.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import GenerationConfig


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only, as `generate` does. `[N, T]` -> `[N, T]`."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask_from_ids(completion_ids: Tensor, eos_token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask up to and including the first EOS; and whether each row ran out of budget without one.

    Returns:
        `[N, C]` bool mask of real completion tokens, `[N]` bool truncated flags.
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # [N, C]
    has_eos = is_eos.any(1)  # [N]
    width = completion_ids.shape[1]
    first_eos = torch.where(
        has_eos, is_eos.int().argmax(1), torch.full_like(has_eos, width, dtype=torch.long)
    )
    positions = torch.arange(width, device=completion_ids.device).unsqueeze(0)  # [1, C]
    return positions <= first_eos.unsqueeze(1), ~has_eos


@contextmanager
def plain_generation_config(model) -> Iterator[None]:
    """Hide the checkpoint's generation config from `model.generate` for the duration.

    `generate` fills every option it is not given from `model.generation_config`: a chat checkpoint's
    repetition penalty, top-k, min-p or n-gram ban would reshape the distribution rollouts are drawn from,
    which the loss (and the `static` engine) take to be softmax(logits / temperature) cut by top-p alone.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


@torch.no_grad()
def sample_completions(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    pad_token_id: int,
    eos_token_ids: list[int],
    synced_gpus: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample one completion per prompt row with `model.generate` (greedy when temperature == 0).

    Args:
        model: a transformers causal LM.
        prompt_ids: `[N, P]` left-padded prompts (repeat rows to get several rollouts per question).
        prompt_mask: `[N, P]`.
        synced_gpus: keep generating until every rank is done (needed under ZeRO-3).

    Returns:
        completion ids `[N, C]` (padded with `pad_token_id` after EOS), completion mask `[N, C]`,
            truncated flags `[N]` (no EOS within `max_new_tokens`).
    """
    sampling = temperature > 0
    with plain_generation_config(model):
        out = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask.long(),
            do_sample=sampling,
            temperature=temperature if sampling else None,
            top_p=top_p if sampling else None,
            top_k=0 if sampling else None,  # transformers defaults to top_k=50; GRPO samples everything
            max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_ids,
            synced_gpus=synced_gpus,
        )
    completion_ids = out[:, prompt_ids.shape[1] :]  # [N, C]
    mask, truncated = completion_mask_from_ids(completion_ids, eos_token_ids)
    return completion_ids.masked_fill(~mask, pad_token_id), mask, truncated

"""Rollouts with a transformers causal LM: per-token log-probs and entropy of sampled completions.

Prompts are left-padded and completions right-padded (see `exgrpo_pl.batch`). Positions are derived from
the attention mask in both generation (`exgrpo_pl.engines.generation`, which samples the completions) and
scoring, so the log-probs of a scored completion are exactly the ones it was sampled with (a left-padded row
scored with plain `arange` positions would not be).
"""

from __future__ import annotations

import torch
from torch import Tensor

from exgrpo_pl.engines.generation import position_ids_from_mask
from exgrpo_pl.step.logprobs import DEFAULT_CHUNK_ELEMENTS, token_logps_and_entropy
from exgrpo_pl.step.losses import masked_mean, token_entropy

ENTROPY_METHODS = ("entropy", "confidence_variance")


def policy_logits(
    model, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> Tensor:
    """The model's logits at the last prompt token and every completion token. `[N, C+1, V]`.

    Position t predicts completion token t; the last one predicts past the completion. Only these C+1
    positions go through the output layer (`logits_to_keep`), in the model's dtype.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+C]
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()  # [N, P+C]
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        logits_to_keep=completion_ids.shape[1] + 1,
        use_cache=False,
    ).logits  # [N, C+1, V]


def completion_logits(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """The logits that predicted each completion token, divided by the sampling temperature. `[N, C, V]`.

    Dividing by the temperature, as the sampler did, makes these the logits of the distribution the tokens
    were drawn from. This is a float32 tensor of the full logits' size (`N x C x V x 4` bytes): to get
    log-probs and entropies, `completion_logps` never makes it.
    """
    logits = policy_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # [N, C+1, V]
    return logits[:, :-1].float() / max(temperature, 1e-6)  # [N, C, V] position t predicts token t


def completion_logps(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies) of the completion tokens from one forward pass.

    Beyond the model's own `[N, C+1, V]` logits, memory is bounded by `chunk_elements`: the float32 softmax
    work runs chunk by chunk (`exgrpo_pl.step.logprobs.token_logps_and_entropy`), with or without gradients.

    Returns:
        log-probs `[N, C]` and token entropies `[N, C]` (None when `with_entropy` is False); both are
            only meaningful where `completion_mask` is True.
    """
    logits = policy_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)  # [N, C+1, V]
    temperature = max(temperature, 1e-6)
    return token_logps_and_entropy(
        logits, completion_ids, temperature, with_entropy=with_entropy, chunk_elements=chunk_elements
    )


def compute_entropy(logits: Tensor, mask: Tensor, method: str = "entropy") -> Tensor:
    """One number per trajectory saying how unsure the policy was while writing it.

    Args:
        logits: `[N, C, V]` logits that predicted each completion token.
        mask: `[N, C]` bool, real completion tokens (padding on either side is excluded).
        method: "entropy" (the reference description's default) is the mean token entropy;
            "confidence_variance" (the reference description's alternative) is the variance over tokens of the
            top-token probability.

    Returns:
        `[N]`.
    """
    if method not in ENTROPY_METHODS:
        raise ValueError(f"method={method!r}; allowed: {', '.join(ENTROPY_METHODS)}")
    if method == "entropy":
        return masked_mean(token_entropy(logits), mask, dim=1)
    confidence = torch.softmax(logits.float(), dim=-1).amax(-1)  # [N, C]
    mean = masked_mean(confidence, mask, dim=1)  # [N]
    return masked_mean((confidence - mean.unsqueeze(1)) ** 2, mask, dim=1)


def num_micro_batches(rows: int, micro_batch_size: int) -> int:
    """Forwards `score_entropy` runs for `rows` rows: one per micro-batch."""
    return -(-rows // micro_batch_size)


@torch.no_grad()
def score_entropy(
    model,
    batch,
    temperature: float = 1.0,
    micro_batch_size: int = 64,
    num_forwards: int | None = None,
    pad_token_id: int = 0,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """Mean completion-token entropy of stored trajectories under the CURRENT policy. `[N]`.

    This is what the paper's trajectory selection ranks by. Its official code masks this with an inverted,
    misaligned padding mask (ExGRPO issue #57; `exgrpo_pl.step.official_pick` reproduces that score to
    compare with); here only real completion tokens count, whatever the padding on the prompt side.

    Memory: one micro-batch's forward, its `[micro_batch_size, C+1, V]` logits in the model's dtype, and
    float32 chunks of `chunk_elements` logits (see `completion_logps`), however many rows are scored.

    Args:
        batch: a `RolloutBatch` (or anything with prompt_ids/prompt_mask/completion_ids/completion_mask).
        micro_batch_size: rows per forward.
        num_forwards: run exactly this many forwards, at least `num_micro_batches(N, micro_batch_size)`;
            the extra ones score a one-token dummy row and are discarded. Under ZeRO-3 every forward
            gathers the sharded parameters from all ranks, so ranks with different numbers of
            trajectories must still run the same number of forwards. None: one per micro-batch.
        pad_token_id: the token of the dummy row.
        chunk_elements: logits per float32 chunk of the softmax work.
    """
    entropy = token_entropies(
        model, batch, temperature, micro_batch_size, num_forwards, pad_token_id, chunk_elements
    )  # [N, C]
    return masked_mean(entropy, batch.completion_mask, dim=1)


@torch.no_grad()
def token_entropies(
    model,
    batch,
    temperature: float = 1.0,
    micro_batch_size: int = 64,
    num_forwards: int | None = None,
    pad_token_id: int = 0,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """Entropy of the distribution that predicted each completion token, under the current policy, one
    micro-batch of rows per forward. `[N, C]`, meaningful where `batch.completion_mask` is True. The
    arguments are `score_entropy`'s."""
    rows_total = batch.prompt_ids.shape[0]
    needed = num_micro_batches(rows_total, micro_batch_size)
    if num_forwards is not None and num_forwards < needed:
        raise ValueError(
            f"num_forwards={num_forwards} is fewer than the {needed} micro-batches of {rows_total} rows"
        )
    entropies = [batch.completion_ids.new_zeros((0, batch.completion_ids.shape[1]), dtype=torch.float32)]
    for start in range(0, rows_total, micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        _, entropy = completion_logps(
            model,
            batch.prompt_ids[rows],
            batch.prompt_mask[rows],
            batch.completion_ids[rows],
            batch.completion_mask[rows],
            temperature,
            chunk_elements=chunk_elements,
        )
        entropies.append(entropy.float())
    if num_forwards is not None and num_forwards > needed:
        # One real token (an all-masked row can make attention produce NaN) and no completion: the
        # cheapest call that still runs every layer, hence every parameter gather.
        device = batch.prompt_ids.device
        dummy = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
        empty = dummy[:, :0]
        for _ in range(num_forwards - needed):
            policy_logits(model, dummy, torch.ones_like(dummy, dtype=torch.bool), empty, empty.bool())
    return torch.cat(entropies)

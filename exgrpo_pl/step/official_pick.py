"""The official code's trajectory score, reproduced so it can be compared with the paper's.

The paper picks, among a question's stored correct trajectories, the one with the lowest mean token entropy
under the current policy (`score_entropy`). The paper authors' code (github.com/ElliottYan/LUFFY at 01f4ae0,
`ExGRPO/exgrpo/verl/verl/mix_src/experience/experience_helpers.py:69-150`, its issue #57) computes another
number, and this module computes that number:

1. Each candidate is prompt + completion, left-padded; the entropies are taken at the distributions that
   predict the last T tokens of that sequence (T = the longest completion allowed). Where fewer than T + 1
   tokens exist, the missing positions count 0 (the official forward removes padding and fills it back with
   zeros; the first token has no prediction).
2. The candidates are scored in chunks of 8, in order; the last chunk is topped up with all-padding rows.
3. Row i's score is the mean of its T entropies where row `i % 8` *of the last chunk*, its completion
   right-padded to T, holds the padding token: an inverted mask taken from another row. For a partner
   completion of l tokens (none equal to the padding token) that is positions l..T-1, i.e. the end of row
   i's prompt and completion together; a mask with no position gives NaN, which the official `argmin` picks
   first.

The effect is to favour short trajectories. `trajectory_selection="official_inverted_mask_entropy"` ranks by
this score, to compare with; ExGRPO's presets rank by the paper's.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from exgrpo_pl.step.logprobs import DEFAULT_CHUNK_ELEMENTS
from exgrpo_pl.step.rollout import token_entropies

OFFICIAL_CHUNK = 8  # BATCH_SIZE of the official compute_postcal_metrics


@torch.no_grad()
def official_pick_scores(
    model,
    batch,
    window: int,
    temperature: float = 1.0,
    micro_batch_size: int = 64,
    num_forwards: int | None = None,
    pad_token_id: int = 0,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """`[N]` the official code's score of each candidate of `batch`, in order (lower is picked). The
    arguments but `window` are `exgrpo_pl.step.rollout.score_entropy`'s, with as many forwards.

    Args:
        window: T, the official `max_target_length`: the longest completion allowed.
        pad_token_id: the tokenizer's padding token, which the official mask compares with.
    """
    entropies = sequence_tail_entropies(
        model, batch, window, temperature, micro_batch_size, num_forwards, pad_token_id, chunk_elements
    )
    return inverted_mask_scores(entropies, batch.completion_ids, batch.completion_mask, pad_token_id)


def sequence_tail_entropies(
    model,
    batch,
    window: int,
    temperature: float,
    micro_batch_size: int,
    num_forwards: int | None,
    pad_token_id: int,
    chunk_elements: int,
) -> Tensor:
    """`[N, window]` entropies of the distributions that predicted the last `window` tokens of each row's
    prompt + completion, right-aligned, 0 where no such token or prediction exists.

    Each row is rescored as its first token followed by all the others as one completion, so that
    `token_entropies` gives the prediction of every token after the first (positions from the attention
    mask, as when sampling, so the values are those of the left-padded sequence)."""
    tokens, real = _real_tokens_first(
        torch.cat([batch.prompt_ids, batch.completion_ids], dim=1),
        torch.cat([batch.prompt_mask, batch.completion_mask], dim=1),
        pad_token_id,
    )
    whole = SimpleNamespace(
        prompt_ids=tokens[:, :1],
        prompt_mask=real[:, :1],
        completion_ids=tokens[:, 1:],
        completion_mask=real[:, 1:],
    )
    predicted = token_entropies(
        model, whole, temperature, micro_batch_size, num_forwards, pad_token_id, chunk_elements
    )  # [N, L-1]: column j predicts token j + 1
    column = real.sum(1, keepdim=True) - window - 1 + torch.arange(window, device=tokens.device)  # [N, T]
    tail = predicted.gather(1, column.clamp(min=0, max=max(predicted.shape[1] - 1, 0)))
    return torch.where(column >= 0, tail, torch.zeros_like(tail))


def inverted_mask_scores(
    entropies: Tensor, completion_ids: Tensor, completion_mask: Tensor, pad_token_id: int
) -> Tensor:
    """`[N]` row i's mean of `entropies[i]` (`[N, T]`) where the last chunk's row `i % 8`, its completion
    right-padded to T with `pad_token_id`, holds `pad_token_id` (NaN where it holds none)."""
    rows, window = entropies.shape
    responses, _ = _real_tokens_first(completion_ids, completion_mask, pad_token_id)
    # Right-padded to T, or cut to T, as the official code tokenizes a completion.
    responses = torch.nn.functional.pad(
        responses, (0, max(window - responses.shape[1], 0)), value=pad_token_id
    )
    padding = responses[:, :window] == pad_token_id  # [N, T]
    last_chunk = (rows - 1) // OFFICIAL_CHUNK * OFFICIAL_CHUNK
    partner = last_chunk + torch.arange(rows, device=entropies.device) % OFFICIAL_CHUNK
    # Partners past the end are the official top-up rows: all padding.
    all_padding = torch.ones(1, window, dtype=torch.bool, device=entropies.device)
    mask = torch.cat([padding, all_padding])[partner.clamp(max=rows)]
    counted = mask.sum(1)
    total = (entropies.double() * mask).sum(1)
    return torch.where(counted > 0, total / counted.clamp(min=1), torch.full_like(total, float("nan")))


def _real_tokens_first(ids: Tensor, mask: Tensor, pad_token_id: int) -> tuple[Tensor, Tensor]:
    """`ids` (`[N, L]`) with each row's real tokens (`mask`) moved to the front in order and `pad_token_id`
    after them, and the mask that goes with it."""
    real = mask.bool()
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices  # stable: real tokens keep order
    packed_mask = torch.arange(ids.shape[1], device=ids.device) < real.sum(1, keepdim=True)
    return torch.where(packed_mask, ids.gather(1, order), torch.full_like(ids, pad_token_id)), packed_mask

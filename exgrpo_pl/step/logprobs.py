"""Per-token log-probs and entropies from a policy's logits, in chunks of bounded size.

The logits of N rows of C completion tokens over a vocabulary of V words are `[N, C, V]`: in bf16 half the
size of the float32 tensors the softmax needs, and one float32 copy of them per row of 256 tokens of a
151,936-word vocabulary is 156 MB. Log-probs and entropies are computed here on chunks of at most about
`chunk_elements` logits (rows x positions flattened), so their float32 work is bounded by the chunk,
whatever N and C; with gradients, only the logits are kept for the backward pass, which recomputes each
chunk's softmax, instead of three float32 copies of the whole tensor.

Every chunk runs the same operations as the whole tensor would (`selective_log_softmax` and
`token_entropy` of `exgrpo_pl.step.losses`), row by row, so the results do not depend on the chunk size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from exgrpo_pl.step.losses import token_entropy

# Logits per chunk: 2**24 float32 elements are 64 MiB, and a chunk's work holds about four such tensors.
DEFAULT_CHUNK_ELEMENTS = 2**24


def chunk_bounds(rows: int, vocab_size: int, chunk_elements: int) -> list[tuple[int, int]]:
    """`[start, end)` ranges of the flattened positions, each of about `chunk_elements` logits.

    A chunk holds at least two positions whenever there are two: a reduction with a single output runs
    a different (multi-threaded) summation on CPU, whose last bits would then depend on the chunk size.
    The last chunk takes a single leftover position, so a chunk may hold one position more than the
    budget allows.
    """
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements={chunk_elements}: must be >= 1")
    size = max(2, chunk_elements // max(vocab_size, 1))
    bounds = [(start, min(start + size, rows)) for start in range(0, rows, size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], rows)]
    return bounds


def _work_dtype(logits: Tensor) -> torch.dtype:
    """float32 for bf16/fp16/fp32 logits (as `.float()`), float64 for float64 ones."""
    return torch.promote_types(logits.dtype, torch.float32)


class _TokenScores(torch.autograd.Function):
    """Log-probs and entropies of flattened positions; the backward recomputes each chunk's softmax."""

    @staticmethod
    def forward(ctx, logits, token_ids, temperature, with_entropy, chunk_elements):
        # logits [M, V] in any float dtype, token_ids [M]; forward runs without autograd recording.
        rows, dtype = logits.shape[0], _work_dtype(logits)
        logps = logits.new_empty(rows, dtype=dtype)  # [M]
        lse = logits.new_empty(rows, dtype=dtype)  # [M] kept for the backward
        entropy = logits.new_empty(rows, dtype=dtype) if with_entropy else None  # [M]
        for start, end in chunk_bounds(rows, logits.shape[1], chunk_elements):
            x = logits[start:end].to(dtype) / temperature  # [m, V]
            picked = x.gather(-1, token_ids[start:end].unsqueeze(-1)).squeeze(-1)  # [m]
            lse[start:end] = torch.logsumexp(x, dim=-1)  # as selective_log_softmax computes it
            logps[start:end] = picked - lse[start:end]
            if with_entropy:
                entropy[start:end] = token_entropy(x)
            del x, picked
        ctx.temperature, ctx.chunk_elements = temperature, chunk_elements
        ctx.set_materialize_grads(False)  # an output the loss never used gets None: its term is skipped
        ctx.save_for_backward(logits, token_ids, lse, entropy if with_entropy else None)
        if entropy is not None:
            return logps, entropy
        return logps, logps.new_zeros(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logps, grad_entropy):
        # d logp_t / dx = onehot(t) - p;  dH / dx = -p (log p + H);  x = logits / temperature.
        logits, token_ids, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        use_entropy = entropy is not None and grad_entropy is not None
        grad = torch.empty_like(logits)  # [M, V] in the logits' dtype, as autograd expects
        temperature = ctx.temperature
        for start, end in chunk_bounds(logits.shape[0], logits.shape[1], ctx.chunk_elements):
            x = logits[start:end].to(lse.dtype) / temperature  # [m, V]
            logp = x.sub_(lse[start:end].unsqueeze(-1))  # [m, V] in place: x is not needed again
            g_logps = (
                grad_logps[start:end] if grad_logps is not None else logp.new_zeros(end - start)
            ).unsqueeze(-1)  # [m, 1]
            if use_entropy:
                g_entropy = grad_entropy[start:end].unsqueeze(-1)  # [m, 1]
                weight = (logp + entropy[start:end].unsqueeze(-1)).mul_(g_entropy).add_(g_logps)  # [m, V]
            else:
                weight = g_logps
            chunk = logp.exp_().mul_(weight).neg_()  # [m, V] -p (g_logps + g_entropy (log p + H))
            chunk.scatter_add_(-1, token_ids[start:end].unsqueeze(-1), g_logps)
            grad[start:end] = chunk.div_(temperature)
            del x, logp, weight, chunk
        return grad, None, None, None, None


def token_logps_and_entropy(
    logits: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each token and entropy of each next-token distribution, at `logits / temperature`.

    Equal to `selective_log_softmax(x, token_ids)` and `token_entropy(x)` of `exgrpo_pl.step.losses` with
    `x = logits[:, :C].float() / temperature` (float64 logits stay float64), computed on chunks of about
    `chunk_elements` logits, so that no float32 tensor of the logits' size is ever made. Differentiable
    with respect to `logits`; the backward keeps only `logits` and recomputes the softmax chunk by chunk.

    Args:
        logits: `[N, L, V]` (L >= C), any float dtype; position t predicts `token_ids[:, t]`, positions from
            C on are ignored (so a model's `[N, C+1, V]` output can be passed whole).
        token_ids: `[N, C]` long.
        temperature: the logits are divided by it (> 0), as the sampler did.
        with_entropy: also compute the entropies.
        chunk_elements: logits per chunk (rows x positions x V); at least two positions are taken.

    Returns:
        `[N, C]` log-probs and `[N, C]` entropies, float32 (None when `with_entropy` is False).
    """
    n, c = token_ids.shape
    if logits.dim() != 3 or logits.shape[0] != n or logits.shape[1] < c:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not cover token_ids of shape {tuple(token_ids.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    length, vocab = logits.shape[1], logits.shape[2]
    if c == 0:
        empty = logits.new_zeros(n, 0, dtype=_work_dtype(logits))
        return empty, empty.clone() if with_entropy else None
    # Positions past C get token 0: scored and dropped, with a zero gradient.
    ids = torch.nn.functional.pad(token_ids, (0, length - c)) if length > c else token_ids  # [N, L]
    logps, entropy = _TokenScores.apply(
        logits.reshape(n * length, vocab), ids.reshape(-1), float(temperature), with_entropy, chunk_elements
    )
    logps = logps.view(n, length)[:, :c]  # [N, C]
    return logps, entropy.view(n, length)[:, :c] if with_entropy else None

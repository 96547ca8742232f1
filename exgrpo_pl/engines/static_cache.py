"""The `static` engine's memory: shape buckets, the `StaticCache` of each laid out on one shared arena, and
the buffers a compiled decode step reads and writes (`Bucket`), all at addresses that never move, so a CUDA
graph recorded on them stays valid. Used by `exgrpo_pl.engines.static`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import StaticCache

from exgrpo_pl.engines.base import SamplingConfig


def bucket_size(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; past the largest, the next multiple of the largest."""
    for size in buckets:
        if size >= n:
            return size
    return -(-n // buckets[-1]) * buckets[-1]


def check_buckets(name: str, buckets) -> tuple[int, ...]:
    """`buckets` as a tuple; ValueError naming `name` unless it is a non-empty increasing tuple of positive
    ints."""
    buckets = tuple(buckets)
    if (
        not buckets
        or any(not isinstance(b, int) or b < 1 for b in buckets)
        or list(buckets) != sorted(buckets)
    ):
        raise ValueError(f"{name}={buckets!r}: want a non-empty increasing tuple of positive ints")
    return buckets


def mark_static(tensor: Tensor) -> None:
    """Tell the compiler `tensor` keeps its address, so a CUDA graph reads it where it is.

    Unguarded, as torch >= 2.9 does by default: older torch guards the tensor's identity by default (a
    recompilation for every new bucket) and keeps guarded tensors alive until `torch._dynamo.reset()`.
    """
    torch._dynamo.mark_static_address(tensor, guard=False)


def meta_cache(config, rows: int, length: int, dtype: torch.dtype) -> StaticCache:
    """A `StaticCache` of `rows` x `length` slots laid out on the meta device: shapes, no memory."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cache = StaticCache(config=config, max_cache_len=length)
    cache.early_initialization(rows, heads, head_dim, dtype, torch.device("meta"))
    return cache


def kv_numel(cache: StaticCache) -> int:
    """Elements of every layer's keys and values."""
    return sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)


def place(cache: StaticCache, arena: Tensor) -> None:
    """Make a meta-laid-out cache real: its keys and values become consecutive views of the flat `arena`.

    Every bucket's cache starts at the arena's first element, so all buckets share one allocation, the size
    of the largest; calls never overlap, and each zeroes its part first (`load`). A view keeps the arena's
    address, so a CUDA graph recorded on it stays valid.
    """
    offset = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            shape = getattr(layer, name).shape
            view = arena[offset : offset + shape.numel()].view(shape)
            offset += shape.numel()
            setattr(layer, name, view)
            mark_static(view)
        layer.device = arena.device
        layer.cumulative_length = torch.zeros((), dtype=torch.long, device=arena.device)
        mark_static(layer.cumulative_length)
        left = [key for key, value in vars(layer).items() if isinstance(value, Tensor) and value.is_meta]
        if left:
            raise ValueError(
                f"rollout_engine='static' does not know the cache layer {type(layer).__name__} "
                f"(state {left}); use rollout_engine='hf'"
            )


class Bucket:
    """What one generation shape keeps between calls: the KV cache and every buffer the compiled step touches.

    The buffers are allocated once and marked as static addresses, so a CUDA graph recorded on them stays
    valid; each call copies its inputs into them in place. The cache's keys and values are views of the
    engine's arena (`place`).
    """

    def __init__(self, cache: StaticCache, rows: int, length: int, device: torch.device) -> None:
        self.rows, self.length = rows, length
        self.cache = cache
        self.attention_mask = torch.zeros(rows, length, dtype=torch.bool, device=device)  # [R, L]
        self.tokens = torch.zeros(rows, length, dtype=torch.long, device=device)  # [R, L] completion columns
        self.logps = torch.zeros(rows, length, dtype=torch.float32, device=device)  # [R, L]
        self.last = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [R, 1] token the next step feeds
        self.position = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [R, 1] its position id
        self.slot = torch.zeros((), dtype=torch.long, device=device)  # the cache slot the next step writes
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)  # [R] an EOS was written
        self.step = torch.zeros((), dtype=torch.long, device=device)  # next completion column
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.pad = torch.zeros((), dtype=torch.long, device=device)
        self.eos = torch.zeros(0, dtype=torch.long, device=device)  # [E]
        for buffer in self._buffers():
            mark_static(buffer)

    def _buffers(self) -> list[Tensor]:
        return [
            self.attention_mask, self.tokens, self.logps, self.last, self.position, self.slot, self.finished,
            self.step, self.temperature, self.top_p, self.pad, self.eos,
        ]  # fmt: skip

    def load(self, prompt_mask: Tensor, sampling: SamplingConfig) -> None:
        """Reset for a new call of `[R, P]` (padded) prompts.

        The attention mask is exact: the prompt's own mask, then each cache slot marked valid by the step
        that writes it (`_decode_step`). Slots not written yet are never attended to, whether or not the
        attention kernel applies a causal rule to a one-token query (flash attention does not).
        """
        self.cache.reset()
        width = prompt_mask.shape[1]
        self.attention_mask.zero_()
        self.attention_mask[:, :width].copy_(prompt_mask)
        self.slot.fill_(width)
        self.tokens.zero_()
        self.logps.zero_()
        self.position.copy_(prompt_mask.sum(1, keepdim=True))  # the first completion token's position
        self.finished.zero_()
        self.step.zero_()
        self.temperature.fill_(max(sampling.temperature, 1e-6))
        self.top_p.fill_(sampling.top_p)
        self.pad.fill_(sampling.pad_token_id)
        eos = torch.tensor(sampling.eos_token_ids, dtype=torch.long, device=self.eos.device)
        if eos.shape != self.eos.shape:  # a new EOS count is a new graph input shape: recompiles once
            self.eos = eos
            mark_static(self.eos)
        else:
            self.eos.copy_(eos)

"""The `hf` rollout engine: transformers' `model.generate` with its dynamic KV cache.

It runs anywhere the policy runs: any transformers causal LM, LoRA adapters, DeepSpeed ZeRO-3 and FSDP (with
`synced_gpus`, so every rank keeps stepping until all are done: each forward there is a collective). It is
the reference the other engines are tested against, and the slow one on a GPU: one Python-level step and
dozens of small kernels per token.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from exgrpo_pl.engines.base import Completions, SamplingConfig, generation_mode
from exgrpo_pl.engines.generation import sample_completions


class HFEngine:
    """`model.generate` behind the engine protocol.

    Args:
        model: the policy (a transformers causal LM, or a peft model around one).
        sharded: every forward gathers parameter shards from all ranks (ZeRO-3, FSDP), so ranks generate in
            lockstep (`synced_gpus=True`).
    """

    def __init__(self, model, sharded: bool = False) -> None:
        self.model = model
        self.sharded = sharded

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingConfig) -> Completions:
        with generation_mode(self.model):
            ids, mask, truncated = sample_completions(
                self.model,
                prompt_ids,
                prompt_mask,
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                pad_token_id=sampling.pad_token_id,
                eos_token_ids=list(sampling.eos_token_ids),
                synced_gpus=self.sharded,
            )
        return Completions(ids, mask, truncated)

    def weights_changed(self) -> None:
        """Nothing to do: `generate` runs on the policy's own parameters."""

    def warm_up(self, calls: Sequence[tuple[int, int, SamplingConfig]]) -> None:
        """Nothing to do: `model.generate` compiles nothing and allocates per call."""

"""The rollout-engine protocol: how the trainer asks for completions, whatever samples them.

An engine turns left-padded prompt ids into completions. `ExGRPOModule` builds one by name
(`rollout_engine: hf | static`), calls `generate` for training and validation rollouts, and calls
`weights_changed` after every optimizer step; nothing else in the library knows which engine runs. An engine
that samples with the policy's own parameters (both shipped ones) has nothing to do on a weight change; one
that holds a copy of the weights (a colocated vLLM, say) reloads them there. Before training, the module
calls `warm_up` with the calls the run will make, so that an engine that compiles does it then.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample one batch of completions.

    Args:
        max_new_tokens: the generation budget per row.
        temperature: softmax temperature; 0 means greedy decoding.
        top_p: nucleus mass in (0, 1]; 1 samples the full distribution (top-k is never applied).
        pad_token_id: the id written after a row's EOS.
        eos_token_ids: ids that end a completion.
    """

    max_new_tokens: int
    temperature: float
    top_p: float
    pad_token_id: int
    eos_token_ids: tuple[int, ...]


@dataclass
class Completions:
    """What an engine returns for N prompt rows.

    Args:
        ids: `[N, C]` long completion tokens, `pad_token_id` after the first EOS (C <= max_new_tokens).
        mask: `[N, C]` bool, True up to and including the first EOS.
        truncated: `[N]` bool, True where the budget ran out before an EOS.
        logps: `[N, C]` float32 log-probabilities of the sampled tokens under softmax(logits / temperature),
            before any top-p cut (what the training forward computes for them: a check of the engine's
            numerics; the trainer takes behaviour log-probs from its own forward), 0 on padding and under
            greedy decoding; None when the engine does not have them cheaply.
    """

    ids: Tensor
    mask: Tensor
    truncated: Tensor
    logps: Tensor | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions from the policy."""

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: SamplingConfig) -> Completions:
        """Completions of `[N, P]` left-padded `prompt_ids` (`prompt_mask` bool), one per row."""
        ...

    def weights_changed(self) -> None:
        """The policy's weights were just updated (after each optimizer step)."""
        ...

    def warm_up(self, calls: Sequence[tuple[int, int, SamplingConfig]]) -> None:
        """Before training: prepare for calls of `(rows, prompt width, sampling)` (compile, allocate)."""
        ...


@contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Run the policy as a sampler: eval mode, no autograd, and tensors that outlive inference mode.

    - Eval mode: a transformers layer with gradient checkpointing on drops the KV cache whenever it runs
      in train mode (transformers < 5 checks `self.training` only), and dropout has no place in sampling.
      Rollouts come out the same in train and eval phases, and a compiled engine needs one graph for both.
    - `inference_mode(False)`: Lightning validates under `torch.inference_mode`; an engine's buffers made
      there would be inference tensors, which the next training call could not update in place.
    The modules' train/eval flags are restored afterwards, each as it was.
    """
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.inference_mode(False), torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training

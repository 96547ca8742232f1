"""Rollout engines: what samples the completions of a training step (see `exgrpo_pl.engines.base`):
`build_engine("hf", policy).generate(prompt_ids, prompt_mask, SamplingConfig(...))` returns them.

`hf` samples with `model.generate` (through `generation`, which also derives the positions of padded rows,
as scoring does), `static` with a preallocated KV cache (`static_cache`).

Layer: above the shared basics and the rewards, and importing nothing else of exgrpo_pl, in particular
nothing of the training step (`exgrpo_pl.step`) or the module, which build and call the engines. No Lightning.
"""

from __future__ import annotations

import inspect

from exgrpo_pl.engines.base import Completions, RolloutEngine, SamplingConfig
from exgrpo_pl.engines.hf import HFEngine
from exgrpo_pl.engines.static import StaticCacheEngine

ENGINES = {"hf": HFEngine, "static": StaticCacheEngine}
"""Engine name -> class; every class takes `(model, sharded=..., **options)`."""


def build_engine(name: str, model, sharded: bool = False, options: dict | None = None) -> RolloutEngine:
    """The engine called `name` for `model`.

    Args:
        name: a key of `ENGINES`.
        model: the policy the engine samples from.
        sharded: the policy's parameters are sharded across ranks (ZeRO-3, FSDP).
        options: keyword arguments of the engine's class.
    """
    check_engine(name, options)
    return ENGINES[name](model, sharded=sharded, **(options or {}))


def check_engine(name: str, options: dict | None = None) -> None:
    """ValueError unless `name` is an engine and `options` are keyword arguments of its class."""
    if name not in ENGINES:
        raise ValueError(f"rollout_engine={name!r}; allowed: {', '.join(ENGINES)}")
    try:
        inspect.signature(ENGINES[name]).bind(None, sharded=False, **(options or {}))
    except TypeError as err:
        raise ValueError(f"rollout_engine_options={options!r} do not fit engine {name!r}: {err}") from None


__all__ = [
    "ENGINES",
    "Completions",
    "HFEngine",
    "RolloutEngine",
    "SamplingConfig",
    "StaticCacheEngine",
    "build_engine",
    "check_engine",
]

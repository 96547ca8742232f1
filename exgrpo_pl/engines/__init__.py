"""Rollout engines: what samples the completions of a training step (see `exgrpo_pl.engines.base`).

    engine = build_engine("hf", policy)
    completions = engine.generate(prompt_ids, prompt_mask, SamplingConfig(...))
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
    if name not in ENGINES:
        raise ValueError(f"rollout_engine={name!r}; allowed: {', '.join(ENGINES)}")
    engine_class = ENGINES[name]
    try:
        inspect.signature(engine_class).bind(model, sharded=sharded, **(options or {}))
    except TypeError as err:
        raise ValueError(f"rollout_engine_options={options!r} do not fit the {name!r} engine: {err}") from None
    return engine_class(model, sharded=sharded, **(options or {}))


__all__ = [
    "ENGINES",
    "Completions",
    "HFEngine",
    "RolloutEngine",
    "SamplingConfig",
    "StaticCacheEngine",
    "build_engine",
]

"""The global random generators a module of one's own may sample from (torch's CPU and current CUDA device,
NumPy's legacy one, Python's `random`), as tensors and primitives for `ReplayCallback`'s checkpoint state.

`ExGRPOModule` saves torch's states itself; a user's module that samples rollouts inline
(`self.model.generate(do_sample=True)`) draws from these, and without them a resumed run samples other
rollouts than the uninterrupted one from the first step on.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def global_rng_state() -> dict[str, Any]:
    """This process's global generator states; loads with `torch.load(weights_only=True)`."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    version, python_state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if cuda else None,
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },  # fmt: skip
        "python": {
            "version": int(version),
            "state": torch.tensor(python_state, dtype=torch.int64),
            "gauss_next": gauss_next,
        },  # fmt: skip
    }


def restore_global_rng_state(state: dict[str, Any]) -> None:
    """Sets the global generators to what `global_rng_state` saved (CUDA's only where it was saved)."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    numpy_state = state["numpy"]
    np.random.set_state((
        numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
        numpy_state["has_gauss"], numpy_state["cached_gaussian"],
    ))  # fmt: skip
    python_state = state["python"]
    random.setstate(
        (python_state["version"], tuple(python_state["state"].tolist()), python_state["gauss_next"])
    )

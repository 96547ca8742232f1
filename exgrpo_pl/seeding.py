"""One run seed, from which every random stream of a run is derived unless that stream is seeded explicitly.

Lightning's `seed_everything(seed)` (the `seed_everything:` key of a config) seeds torch's global generator,
which samples the rollouts, and records the seed in the environment (`PL_GLOBAL_SEED`, inherited by every
DDP rank). The training data's order, the replay decisions and the validation samples come from generators
of their own, seeded by `derive_seed(purpose)` from that same run seed: two runs with different seeds differ
in all of them, and the same seed reproduces a run exactly. A checkpoint holds the state of every stream
(the global generators of each rank, the data pass and position, the replay generators), so a resumed run
trains on as the checkpointed one would have, whatever seed it is started with (its validation samples
follow the seed it is given). Core module: no Lightning import.
"""

from __future__ import annotations

import os
import zlib


def run_seed() -> int:
    """The seed `seed_everything` set for this run (0 when none was set)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def derive_seed(purpose: str, *keys: int) -> int:
    """A 31-bit seed for one random stream of this run, different for every `purpose` and `keys`.

    Args:
        purpose: which stream, e.g. "data" or "replay".
        keys: further integers that select a sub-stream (e.g. the step of a validation).
    """
    return _hash31(purpose, run_seed(), *keys)


def split_seed(seed: int, *keys: int) -> int:
    """A 31-bit seed for sub-stream `keys` of the stream seeded with `seed` (e.g. one epoch of a data order).

    Unlike `seed + key`, neighbouring seeds share no sub-stream: seed s's epoch 1 is not seed s+1's epoch 0.

    Args:
        seed: the stream's seed.
        keys: integers that select the sub-stream.
    """
    return _hash31("split", seed, *keys)


def _hash31(*parts: object) -> int:
    return zlib.crc32(":".join(str(part) for part in parts).encode()) & 0x7FFFFFFF

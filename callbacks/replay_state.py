"""Where `ReplayCallback`'s per-rank states go in a checkpoint, and which one a rank takes back.

Every rank keeps its own buffer. `"ranks"` holds rank states in rank order, and where they go depends on who
writes the checkpoint file:

- DDP, DeepSpeed ZeRO 0-2, one process: rank 0 alone writes the file that every rank reads back
  (DeepSpeed: `checkpoint/mp_rank_00_model_states.pt`), so every rank's state is gathered to rank 0 (every
  rank runs `state_dict`): `{"ranks": [rank 0's, ..., rank N-1's]}`; the other ranks, which write nothing,
  return their own. The gather runs over a gloo group, in CPU memory: over the default NCCL group the
  pickled buffers would be staged on the GPU, N of them on rank 0.
- DeepSpeed ZeRO-3: DeepSpeed writes Lightning's client state, callback states included, into every rank's
  own `checkpoint/zero_pp_rank_<r>_mp_rank_00_model_states.pt`, and each rank loads its own file
  (`DeepSpeedEngine._get_ckpt_name`). Gathering would put all N buffers in each of the N files and in each
  rank's memory while saving, so each rank saves only its own state, marked with its rank:
  `{"ranks": [rank r's], "rank": r, "world_size": N}`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist

from exgrpo_pl.callbacks.collectives import object_group, rank_and_world_size


def for_checkpoint(own: dict[str, Any], rank_writes_own_file: bool) -> dict[str, Any]:
    """This rank's state `own` laid out for the checkpoint (see the module docstring); a collective under
    DDP and ZeRO 0-2: every rank must call it.

    Args:
        own: this rank's state.
        rank_writes_own_file: DeepSpeed ZeRO-3, where each rank writes its own file.
    """
    rank, world_size = rank_and_world_size()
    if rank_writes_own_file:
        return {"ranks": [own], "rank": rank, "world_size": world_size}
    if world_size > 1:
        ranks: list[Any] | None = [None] * world_size if rank == 0 else None
        dist.gather_object(own, ranks, dst=0, group=object_group())
        return {"ranks": ranks} if rank == 0 else {"ranks": [own], "rank": rank, "world_size": world_size}
    return {"ranks": [own]}


def own_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """This rank's own state, from either layout that `for_checkpoint` writes.

    `"ranks"` holds the states of saved ranks `"rank"`, `"rank"` + 1, ... (no `"rank"`: from 0) of a run of
    `"world_size"` ranks (none given: `len(ranks)`), and rank r takes saved rank r's. Where that is missing,
    rank r takes entry `r % len(ranks)`, so ranks share buffers rather than start empty (the decision
    generator and the replay phase are the same on all saved ranks); the rank warns about that, as about any
    change of world size:

    - a gathered checkpoint resumed by more ranks (a one-process checkpoint's state goes to every rank);
      resumed by fewer, the buffers of the saved ranks beyond them are dropped.
    - a ZeRO-3 file holds one rank's state, and each rank reads its own file. DeepSpeed refuses a plain ZeRO-3
      resume with another world size (a new rank has no file; the optimizer partitions are sized for the old
      world), so a rank reads another's file only where every rank is handed rank 0's: DeepSpeed's universal
      checkpoints, or one file made by Lightning's `convert_zero_checkpoint_to_fp32_state_dict`. Every rank
      then starts from rank 0's state.
    """
    ranks = state_dict["ranks"]
    first = state_dict.get("rank", 0)
    saved_world_size = state_dict.get("world_size", len(ranks))
    rank, world_size = rank_and_world_size()
    index = rank - first if first <= rank < first + len(ranks) else rank % len(ranks)
    if first + index != rank or saved_world_size != world_size:
        warnings.warn(
            f"ReplayCallback: replay state saved by {saved_world_size} rank(s) is resumed by "
            f"{world_size}: rank {rank} takes saved rank {first + index}'s buffer",
            stacklevel=3,
        )
    return ranks[index]

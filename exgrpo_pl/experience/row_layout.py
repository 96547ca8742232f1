"""What one stored trajectory holds in the replay buffer (`SlotStorage`, `exgrpo_pl.experience.storage`):
its metadata columns, its token payloads and texts, which `RolloutBatch` field each comes from, and the
payload of a batch's rows (their tokens trimmed and back to back, in the stored dtypes) that the buffer
hands to the storage and the de-duplication. Plain NumPy, no Lightning.
"""

from __future__ import annotations

import numpy as np
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.ragged import ragged_index

COLUMNS = {
    "occupied": np.bool_,
    "question_id": np.int64,
    "qidx": np.int64,  # the bucketer's dense index of the question; -1 for free slots and unknown questions
    "reward": np.float32,
    "correct": np.bool_,
    "entropy": np.float32,
    "policy_version": np.int64,
    "seq": np.int64,  # insertion order, for oldest-first eviction
    "domain": np.int64,  # index into the buffer's domain names; -1 for none
    "hash": np.uint64,  # 64-bit hash of the completion ids, for de-duplication (0 without it)
}
# Token payloads, one RaggedStore per length: store -> (its mask in a RolloutBatch, its length key in a
# state dict, its fields and their stored dtypes).
TOKENS = {
    "prompt": ("prompt_mask", "prompt_len", {"prompt_ids": np.int32}),
    "completion": (
        "completion_mask",
        "completion_len",
        {"completion_ids": np.int32, "behaviour_logps": np.float32},
    ),
}
TEXTS = ("prompts", "completions", "answers")
BATCH_FIELDS = {
    "question_id": "question_ids",
    "reward": "rewards",
    "correct": "correct",
    "entropy": "entropy",
    "policy_version": "policy_version",
}
DERIVED = ("occupied", "qidx", "hash")  # rebuilt on load, not saved
WIDE = {"prompt_ids": np.int64, "completion_ids": np.int64}  # RolloutBatch's dtypes for the stored int32

Payload = dict[str, tuple[np.ndarray, dict[str, np.ndarray]]]  # store -> (lengths [n], field -> flat values)


def batch_payload(batch: RolloutBatch, rows: np.ndarray) -> Payload:
    """The token payloads of `rows`, trimmed and back to back, in their stored dtypes."""
    out = {}
    for store, (mask_name, _, fields) in TOKENS.items():
        mask = as_numpy(getattr(batch, mask_name))[rows]  # [n, width]
        out[store] = (
            mask.sum(1),
            {
                name: as_numpy(getattr(batch, name))[rows][mask].astype(dtype)
                for name, dtype in fields.items()
            },
        )
    return out


def payload_subset(payload: Payload, keep: np.ndarray) -> Payload:
    """The rows of `payload` where `keep` (`[n]` bool) holds."""
    if keep.all():
        return payload
    out = {}
    for store, (lengths, flat) in payload.items():
        index = ragged_index(np.cumsum(lengths)[keep] - lengths[keep], lengths[keep])
        out[store] = (lengths[keep], {name: values[index] for name, values in flat.items()})
    return out


def as_numpy(t: Tensor) -> np.ndarray:
    """A tensor's values as a NumPy array on the CPU, floats as float32."""
    t = t.detach().cpu()
    return (t.float() if t.is_floating_point() else t).numpy()

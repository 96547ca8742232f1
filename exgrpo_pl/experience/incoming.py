"""What `TrajectoryBuffer.add` reads from what it is given: the reference description's trajectory dict as
a `RolloutBatch`, and which rows of a batch are evidence of their question's difficulty. Plain PyTorch."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from exgrpo_pl.batch import RolloutBatch, text_id
from exgrpo_pl.experience.row_layout import as_numpy

_SEED_KEYS = ("prompt", "rollout", "reward", "is_correct", "entropy")


def counted_rows(batch: RolloutBatch, replayed: np.ndarray) -> np.ndarray:
    """`[N]` bool: the rows that are evidence of difficulty, fresh rows and replayed rows that share their
    group (`group_size` contiguous rows) with fresh rows of the same question."""
    counted = ~replayed
    k = batch.group_size
    if k > 1 and replayed.any() and counted.any():
        questions = as_numpy(batch.question_ids).reshape(-1, k)  # [G, K]
        fresh = counted.reshape(-1, k)
        with_fresh = ((questions[:, :, None] == questions[:, None, :]) & fresh[:, None, :]).any(2)  # [G, K]
        counted = counted | (replayed & with_fresh.reshape(-1))
    return counted


def batch_from_trajectory_dict(trajectory: Mapping) -> RolloutBatch:
    """The reference description's trajectory dict (`TrajectoryBuffer.add` lists its keys) as a one-row
    `RolloutBatch`; a missing required key is an error naming it."""
    missing = [key for key in _SEED_KEYS if key not in trajectory]
    if missing:
        raise ValueError(f"trajectory dict is missing keys {missing}; required keys are {list(_SEED_KEYS)}")
    prompt = str(trajectory["prompt"])
    question_id = trajectory.get("question_id", text_id(prompt))
    prompt_ids = torch.as_tensor(trajectory.get("prompt_ids", []), dtype=torch.long).reshape(1, -1)
    completion_ids = torch.as_tensor(trajectory.get("completion_ids", []), dtype=torch.long).reshape(1, -1)
    logps = trajectory.get("behaviour_logps")
    logps = (
        torch.zeros(completion_ids.shape) if logps is None else torch.as_tensor(logps).float().reshape(1, -1)
    )
    return RolloutBatch(
        question_ids=torch.tensor([int(question_id)]),
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones(prompt_ids.shape, dtype=torch.bool),
        completion_ids=completion_ids,
        completion_mask=torch.ones(completion_ids.shape, dtype=torch.bool),
        behaviour_logps=logps,
        rewards=torch.tensor([float(trajectory["reward"])]),
        correct=torch.tensor([bool(trajectory["is_correct"])]),
        entropy=torch.tensor([float(trajectory["entropy"])]),
        advantages=torch.zeros(1),
        policy_version=torch.tensor([int(trajectory.get("policy_version", 0))]),
        replayed=torch.zeros(1, dtype=torch.bool),
        prompts=[prompt],
        completions=[str(trajectory["rollout"])],
        answers=[str(trajectory["answer"])] if "answer" in trajectory else [],
        domains=[str(trajectory["domain"])] if "domain" in trajectory else None,
    )

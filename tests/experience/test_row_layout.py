"""What a stored row holds: a batch's rows as token payloads (trimmed, back to back, in stored dtypes), and
a subset of such a payload, on exact small cases."""

import numpy as np
import torch

from exgrpo_pl.batch import RolloutBatch, pad_sequences
from exgrpo_pl.experience.row_layout import as_numpy, batch_payload, payload_subset


def three_rows() -> RolloutBatch:
    """Prompts of 1, 2 and 3 tokens (left-padded), completions of 2, 1 and 3 (right-padded)."""
    prompts = [torch.tensor([7]), torch.tensor([8, 9]), torch.tensor([4, 5, 6])]
    completions = [torch.tensor([1, 2]), torch.tensor([3]), torch.tensor([10, 11, 12])]
    prompt_ids, prompt_mask = pad_sequences(prompts, left=True)
    completion_ids, completion_mask = pad_sequences(completions, left=False)
    logps = torch.tensor([[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0], [-0.125, -2.0, -4.0]], dtype=torch.float64)
    return RolloutBatch(
        question_ids=torch.tensor([0, 0, 1]), prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=completion_ids, completion_mask=completion_mask, behaviour_logps=logps,
        rewards=torch.tensor([1.0, 0.0, 1.0]), correct=torch.tensor([True, False, True]),
        entropy=torch.tensor([0.1, 0.2, 0.3]), advantages=torch.zeros(3),
        policy_version=torch.zeros(3, dtype=torch.long), replayed=torch.zeros(3, dtype=torch.bool),
        group_size=1,
    )  # fmt: skip


def test_a_batchs_rows_become_trimmed_back_to_back_payloads_in_stored_dtypes():
    payload = batch_payload(three_rows(), np.array([2, 0]))
    lengths, flat = payload["prompt"]
    assert lengths.tolist() == [3, 1] and flat["prompt_ids"].tolist() == [4, 5, 6, 7]
    assert flat["prompt_ids"].dtype == np.int32
    lengths, flat = payload["completion"]
    assert lengths.tolist() == [3, 2] and flat["completion_ids"].tolist() == [10, 11, 12, 1, 2]
    assert flat["behaviour_logps"].tolist() == [-0.125, -2.0, -4.0, -0.5, -0.25]
    assert flat["behaviour_logps"].dtype == np.float32


def test_a_subset_keeps_the_rows_asked_for_and_their_tokens_only():
    payload = batch_payload(three_rows(), np.arange(3))
    kept = payload_subset(payload, np.array([True, False, True]))
    assert kept["prompt"][0].tolist() == [1, 3] and kept["prompt"][1]["prompt_ids"].tolist() == [7, 4, 5, 6]
    assert kept["completion"][1]["completion_ids"].tolist() == [1, 2, 10, 11, 12]
    assert payload_subset(payload, np.ones(3, dtype=bool)) is payload  # all kept: no copy


def test_tensors_come_out_as_cpu_numpy_with_floats_as_float32():
    assert as_numpy(torch.tensor([1.5], dtype=torch.float64)).dtype == np.float32
    assert as_numpy(torch.tensor([3])).dtype == np.int64

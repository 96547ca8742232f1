"""exgrpo_pl.step.rollout: the alignment of scored log-probs and entropies, and the entropy measures."""

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exgrpo_pl.engines.generation import sample_completions
from exgrpo_pl.models import load_policy
from exgrpo_pl.step.losses import masked_mean, selective_log_softmax, token_entropy
from exgrpo_pl.step.rollout import (
    completion_logits,
    completion_logps,
    compute_entropy,
    num_micro_batches,
    score_entropy,
)

# Next-token logits chosen per input token, so every entropy below is known by hand.
TABLE = torch.log(torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.5, 0.25, 0.25], [0.9, 0.05, 0.05]]))
H = [float(-(row.exp() * row).sum()) for row in TABLE]


class TableModel:
    """A 'language model' whose logits at a position depend only on the token there; records positions."""

    def __call__(self, input_ids, attention_mask, position_ids, logits_to_keep, use_cache):
        self.position_ids = position_ids
        return SimpleNamespace(logits=TABLE[input_ids][:, -logits_to_keep:])


def test_selection_entropy_counts_completion_tokens_only_with_padding_on_both_sides():
    # Row 0: prompt [pad, pad, 1], completion [2, 1, pad]. Row 1: prompt [1, 2, 2], completion [1, pad, pad].
    batch = SimpleNamespace(
        prompt_ids=torch.tensor([[0, 0, 1], [1, 2, 2]]),
        prompt_mask=torch.tensor([[False, False, True], [True, True, True]]),
        completion_ids=torch.tensor([[2, 1, 0], [1, 0, 0]]),
        completion_mask=torch.tensor([[True, True, False], [True, False, False]]),
    )
    # Completion token j is predicted by the logits at the token before it: the last prompt token, then
    # the completion's own tokens. Row 0: tokens 1 and 2 predict; row 1: prompt token 2 predicts.
    expected = torch.tensor([(H[1] + H[2]) / 2, H[2]])
    assert torch.allclose(score_entropy(TableModel(), batch), expected, atol=1e-6)


class CountingTableModel(TableModel):
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return super().__call__(*args, **kwargs)


def test_padding_forwards_leave_the_scores_of_real_rows_unchanged():
    """A forced forward count (ZeRO-3 ranks agree on one) adds dummy forwards and nothing else."""
    batch = SimpleNamespace(
        prompt_ids=torch.tensor([[0, 0, 1], [1, 2, 2], [0, 2, 1]]),
        prompt_mask=torch.tensor([[False, False, True], [True, True, True], [False, True, True]]),
        completion_ids=torch.tensor([[2, 1, 0], [1, 0, 0], [0, 1, 2]]),
        completion_mask=torch.tensor([[True, True, False], [True, False, False], [True, True, True]]),
    )
    plain, padded = CountingTableModel(), CountingTableModel()
    expected = score_entropy(plain, batch, micro_batch_size=2)
    assert plain.calls == num_micro_batches(3, 2) == 2
    assert torch.equal(score_entropy(padded, batch, micro_batch_size=2, num_forwards=5), expected)
    assert padded.calls == 5

    empty = SimpleNamespace(**{name: value[:0] for name, value in vars(batch).items()})
    idle = CountingTableModel()
    assert score_entropy(idle, empty, micro_batch_size=2, num_forwards=3).shape == (0,)
    assert idle.calls == 3  # a rank with nothing to rescore still joins the others' forwards
    with pytest.raises(ValueError, match="num_forwards=1 is fewer than the 2 micro-batches"):
        score_entropy(CountingTableModel(), batch, micro_batch_size=2, num_forwards=1)


def test_logps_are_those_of_the_tokens_and_positions_follow_the_mask():
    model = TableModel()
    logps, entropy = completion_logps(
        model,
        torch.tensor([[0, 1]]),
        torch.tensor([[False, True]]),
        torch.tensor([[2, 0]]),
        torch.tensor([[True, True]]),
    )
    assert torch.allclose(logps, torch.tensor([[math.log(0.25), math.log(0.9)]]))
    assert torch.allclose(entropy, torch.tensor([[H[1], H[2]]]), atol=1e-6)
    assert model.position_ids.tolist() == [[0, 0, 1, 2]]


def test_compute_entropy_methods_by_hand():
    logits = TABLE[torch.tensor([[1, 2, 0]])]  # [1, 3, V]
    mask = torch.tensor([[True, True, False]])
    assert torch.allclose(compute_entropy(logits, mask), torch.tensor([(H[1] + H[2]) / 2]))
    variance = ((0.5 - 0.7) ** 2 + (0.9 - 0.7) ** 2) / 2  # top-token probabilities 0.5 and 0.9
    assert torch.allclose(compute_entropy(logits, mask, "confidence_variance"), torch.tensor([variance]))


def test_sampled_logps_match_a_rescoring_forward_pass(tiny_model_dir):
    """What generate sampled from and what the update scores are the same distribution (left padding)."""
    model = load_policy(tiny_model_dir)
    torch.manual_seed(0)
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 4]])
    prompt_mask = prompt_ids != 0
    ids, mask, _ = sample_completions(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=3,
        temperature=1.0,
        top_p=1.0,
        pad_token_id=0,
        eos_token_ids=[2],
    )
    logps, _ = completion_logps(model, prompt_ids, prompt_mask, ids, mask)
    # Score again with the row alone, without left padding: same numbers if positions are right.
    alone, _ = completion_logps(model, prompt_ids[:1, 2:], prompt_mask[:1, 2:], ids[:1], mask[:1])
    assert torch.allclose(logps[0][mask[0]], alone[0][mask[0]], atol=1e-5)


def padded_batch(seed: int, rows: int, prompt_width: int, completion_width: int, vocab: int):
    """Random rows; prompts left-padded, completions right-padded, to random lengths (at least 1 token)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, prompt_width + 1, (rows,), generator=g)
    completion_len = torch.randint(1, completion_width + 1, (rows,), generator=g)
    prompt_mask = torch.arange(prompt_width).flip(0) < prompt_len.unsqueeze(1)  # [N, P] left padding
    completion_mask = torch.arange(completion_width) < completion_len.unsqueeze(1)  # [N, C] right padding
    prompt_ids = torch.randint(3, vocab, (rows, prompt_width), generator=g).masked_fill(~prompt_mask, 0)
    completion_ids = torch.randint(3, vocab, (rows, completion_width), generator=g)
    return SimpleNamespace(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids.masked_fill(~completion_mask, 0),
        completion_mask=completion_mask,
    )


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 5),
    prompt_width=st.integers(1, 4),
    completion_width=st.integers(1, 6),
    chunk=st.integers(1, 12),
    micro_batch_size=st.integers(1, 6),
    temperature=st.sampled_from([1.0, 0.6]),
)
def test_rescoring_is_the_whole_tensor_entropy_whatever_the_chunk_and_padding(
    tiny_policy, seed, rows, prompt_width, completion_width, chunk, micro_batch_size, temperature
):
    vocab = tiny_policy.config.vocab_size
    batch = padded_batch(seed, rows, prompt_width, completion_width, vocab)
    with torch.no_grad():
        logits = completion_logits(
            tiny_policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
            temperature,
        )  # fmt: skip  # [N, C, V] float32: what rescoring computed before it was chunked
    expected = masked_mean(token_entropy(logits), batch.completion_mask, dim=1)
    chunked = score_entropy(tiny_policy, batch, temperature, rows, chunk_elements=chunk * vocab)
    torch.testing.assert_close(chunked, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(score_entropy(tiny_policy, batch, temperature, rows, chunk_elements=1), chunked)
    # Another micro-batch runs other matrix shapes through the model: equal to float tolerance.
    micro = score_entropy(tiny_policy, batch, temperature, micro_batch_size, chunk_elements=chunk * vocab)
    torch.testing.assert_close(micro, expected, rtol=1e-5, atol=1e-6)


def test_training_logps_and_gradients_match_the_whole_tensor_path(tiny_policy):
    batch = padded_batch(0, 3, 3, 5, tiny_policy.config.vocab_size)
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask, 0.8)
    weights = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1))

    def gradients(logps, entropy):
        tiny_policy.zero_grad()
        ((logps * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
        return {name: p.grad.clone() for name, p in tiny_policy.named_parameters()}

    logits = completion_logits(tiny_policy, *args)  # [N, C, V] float32, with grad
    want_logps, want_entropy = selective_log_softmax(logits, batch.completion_ids), token_entropy(logits)
    want = gradients(want_logps, want_entropy)
    logps, entropy = completion_logps(tiny_policy, *args, chunk_elements=7)
    assert torch.equal(logps, want_logps) and torch.equal(entropy, want_entropy)
    got = gradients(logps, entropy)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)

"""exgrpo_pl.step.logprobs: chunked log-probs and entropies equal the whole-tensor ones, values and gradients,
whatever the chunk size, and never build a float32 tensor of the logits' size."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from exgrpo_pl.step.logprobs import chunk_bounds, token_logps_and_entropy
from exgrpo_pl.step.losses import selective_log_softmax, token_entropy


def whole_tensor(logits, token_ids, temperature):
    """The unchunked computation: one float32 copy of `[N, C, V]`, then the losses' functions."""
    x = logits[:, : token_ids.shape[1]].float() / temperature  # [N, C, V]
    return selective_log_softmax(x, token_ids), token_entropy(x)


def random_case(seed, rows, length, vocab, extra, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, length + extra, vocab, generator=g) * 4).to(dtype)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    return logits, ids


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 3),
    length=st.integers(1, 5),
    extra=st.integers(0, 2),
    vocab=st.sampled_from([3, 17, 33_000]),  # 33,000 > the CPU reduction grain: the multi-threaded path
    chunks=st.tuples(st.integers(1, 10), st.integers(1, 10)),
    temperature=st.sampled_from([1.0, 0.7]),
    bf16=st.booleans(),
)
def test_any_chunk_size_gives_the_same_values_as_the_whole_tensor(
    seed, rows, length, extra, vocab, chunks, temperature, bf16
):
    logits, ids = random_case(seed, rows, length, vocab, extra, torch.bfloat16 if bf16 else torch.float32)
    want_logps, want_entropy = whole_tensor(logits, ids, temperature)
    first, second = (
        token_logps_and_entropy(logits, ids, temperature, chunk_elements=chunk * vocab) for chunk in chunks
    )
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])  # bit for bit
    # The whole tensor sums a single position's vocabulary in another order on CPU (see chunk_bounds).
    torch.testing.assert_close(first[0], want_logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(first[1], want_entropy, rtol=1e-6, atol=1e-6)
    if rows * length > 1:
        assert torch.equal(first[0], want_logps) and torch.equal(first[1], want_entropy)
    alone, none = token_logps_and_entropy(logits, ids, temperature, with_entropy=False, chunk_elements=1)
    assert torch.equal(alone, first[0]) and none is None


def test_by_hand_with_a_prediction_past_the_completion():
    probs = torch.tensor([[[0.5, 0.25, 0.25], [0.9, 0.05, 0.05], [1 / 3, 1 / 3, 1 / 3]]])  # [1, 3, 3]
    logps, entropy = token_logps_and_entropy(probs.log(), torch.tensor([[1, 0]]))  # 2 tokens, 3 positions
    assert torch.allclose(logps, torch.tensor([[0.25, 0.9]]).log())
    h = -(probs[0, :2] * probs[0, :2].log()).sum(-1)
    assert torch.allclose(entropy, h.unsqueeze(0))


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 3),
    length=st.integers(1, 5),
    extra=st.integers(0, 1),
    chunk=st.integers(1, 7),
    use=st.sampled_from(["both", "logps", "entropy"]),
)
def test_gradients_match_autograd_of_the_whole_tensor(seed, rows, length, extra, chunk, use):
    logits, ids = random_case(seed, rows, length, 11, extra, torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    weights = torch.randn(2, rows, length, generator=g, dtype=torch.float64)

    def loss(logps, entropy):
        terms = {"logps": (logps * weights[0]).sum(), "entropy": (entropy * weights[1]).sum()}
        return terms["logps"] + terms["entropy"] if use == "both" else terms[use]

    reference = logits.clone().requires_grad_()
    x = reference[:, :length] / 0.7  # float64 all the way, so the comparison is tight
    loss(selective_log_softmax(x, ids), token_entropy(x)).backward()
    chunked = logits.clone().requires_grad_()
    loss(*token_logps_and_entropy(chunked, ids, 0.7, chunk_elements=chunk * 11)).backward()
    assert torch.allclose(chunked.grad, reference.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(chunked.grad[:, length:], torch.zeros_like(chunked.grad[:, length:]))


def test_gradcheck():
    logits, ids = random_case(0, 2, 3, 5, 1, torch.float64)
    logits.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: token_logps_and_entropy(x, ids, 0.9, chunk_elements=10), logits)


def test_bf16_logits_get_bf16_gradients_close_to_float32_autograd():
    logits, ids = random_case(3, 2, 4, 50, 1, torch.bfloat16)
    reference = logits.clone().requires_grad_()
    want = whole_tensor(reference, ids, 1.0)
    (want[0].sum() + want[1].sum()).backward()
    chunked = logits.clone().requires_grad_()
    got = token_logps_and_entropy(chunked, ids, chunk_elements=100)
    (got[0].sum() + got[1].sum()).backward()
    assert chunked.grad.dtype == torch.bfloat16
    assert torch.allclose(chunked.grad.float(), reference.grad.float(), atol=1e-2)


class LargestFloat32(TorchDispatchMode):
    """Records the most elements of any float32 tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("grad", [False, True])
def test_float32_work_is_bounded_by_the_chunk(grad):
    rows, length, vocab = 6, 20, 1000
    logits, ids = random_case(0, rows, length, vocab, 1, torch.bfloat16)
    logits.requires_grad_(grad)
    with LargestFloat32() as seen:
        logps, entropy = token_logps_and_entropy(logits, ids, chunk_elements=5 * vocab)
        if grad:
            (logps.sum() + entropy.sum()).backward()
    assert seen.largest <= 6 * vocab  # a chunk (plus one leftover position), never [rows, length, vocab]
    assert logits.grad is None if not grad else logits.grad.shape == logits.shape


@given(rows=st.integers(0, 60), vocab=st.integers(1, 50), chunk=st.integers(1, 400))
def test_chunk_bounds_cover_every_position_with_at_least_two_per_chunk(rows, vocab, chunk):
    bounds = chunk_bounds(rows, vocab, chunk)
    assert [p for start, end in bounds for p in range(start, end)] == list(range(rows))
    size = max(2, chunk // vocab)
    assert all(min(2, rows) <= end - start <= size + 1 for start, end in bounds)


def test_errors_name_the_problem():
    logits, ids = random_case(0, 2, 3, 5, 0)
    with pytest.raises(ValueError, match="do not cover token_ids"):
        token_logps_and_entropy(logits[:, :2], ids)
    with pytest.raises(ValueError, match="chunk_elements=0"):
        token_logps_and_entropy(logits, ids, chunk_elements=0)
    with pytest.raises(ValueError, match="temperature=0"):
        token_logps_and_entropy(logits, ids, 0.0)

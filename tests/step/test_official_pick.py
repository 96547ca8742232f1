"""exgrpo_pl.step.official_pick: the official code's trajectory score, against the official computation
written out step by step (left-padded prompt + completion, the forward's zeros at padding, the last T
positions, chunks of 8 topped up with padding rows, the mask of the last chunk's row i % 8)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exgrpo_pl.models import load_policy
from exgrpo_pl.step.official_pick import inverted_mask_scores, official_pick_scores
from exgrpo_pl.step.rollout import position_ids_from_mask

PAD = 0


def official_tail_entropies(model, batch, window, temperature):
    """The official `compute_log_prob_ents` on each row: prompt + completion left-padded to one length, the
    entropy of every position's next-token distribution, zero at padding (its forward removes padding and
    fills it back with zeros), then the T positions before the last."""
    rows = []
    for i in range(batch.prompt_ids.shape[0]):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]]
        completion = batch.completion_ids[i][batch.completion_mask[i]]
        rows.append(torch.cat([prompt, completion]))
    width = batch.prompt_ids.shape[1] + window  # max_prompt_length + max_target_length
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1) * mask  # [N, width]
    return entropy[:, -window - 1 : -1]


def official_scores(entropies, batch, window):
    """`compute_postcal_metrics`' last loop: `ppl_batch` is the last chunk of 8, topped up with rows of
    padding, and row i is masked where that chunk's row i % 8 (right-padded to T) holds the padding token."""
    rows = entropies.shape[0]
    responses = []
    for i in range(rows):
        real = batch.completion_ids[i][batch.completion_mask[i]][:window]
        responses.append(torch.cat([real, torch.full((window - len(real),), PAD)]))
    chunks = [responses[start : start + 8] for start in range(0, rows, 8)]
    last = chunks[-1] + [torch.full((window,), PAD)] * (8 - len(chunks[-1]))
    scores = []
    for i in range(rows):
        mask = ~(last[i % 8] != PAD)
        scores.append(entropies[i][mask].double().mean().item())
    return torch.tensor(scores, dtype=torch.float64)


def random_rows(seed, rows, prompt_width, window, vocab, pad_inside):
    """Left-padded prompts and right-padded completions of random lengths (a completion may fill the
    window); with `pad_inside`, some completion tokens are the padding token itself (an EOS that is also
    the padding token)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, prompt_width + 1, (rows,), generator=g)
    completion_len = torch.randint(1, window + 1, (rows,), generator=g)
    prompt_mask = torch.arange(prompt_width).flip(0) < prompt_len.unsqueeze(1)
    completion_mask = torch.arange(window) < completion_len.unsqueeze(1)
    completion_ids = torch.randint(1, vocab, (rows, window), generator=g)
    if pad_inside:
        completion_ids[torch.rand(rows, window, generator=g) < 0.2] = PAD
    return _Batch(
        torch.randint(1, vocab, (rows, prompt_width), generator=g).masked_fill(~prompt_mask, PAD),
        prompt_mask,
        completion_ids.masked_fill(~completion_mask, PAD),
        completion_mask,
    )


class _Batch:
    def __init__(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.completion_ids, self.completion_mask = completion_ids, completion_mask


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return load_policy(tiny_model_dir).eval()


@settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 19),
    prompt_width=st.integers(1, 5),
    window=st.integers(2, 7),
    micro_batch_size=st.integers(1, 8),
    temperature=st.sampled_from([1.0, 0.7]),
    pad_inside=st.booleans(),
)
def test_scores_equal_the_official_computation(
    tiny_policy, seed, rows, prompt_width, window, micro_batch_size, temperature, pad_inside
):
    batch = random_rows(seed, rows, prompt_width, window, tiny_policy.config.vocab_size, pad_inside)
    expected = official_scores(
        official_tail_entropies(tiny_policy, batch, window, temperature), batch, window
    )
    got = official_pick_scores(
        tiny_policy, batch, window, temperature, micro_batch_size, pad_token_id=PAD, chunk_elements=64
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_the_mask_comes_from_the_last_chunks_row_and_its_top_up():
    """Ten rows: rows 0-7 and 8-9 form two chunks; the last chunk is rows 8 and 9 and six padding rows.
    Entropies 1.0 everywhere except a marker at each row's position 0, so the mask's reach is visible."""
    window = 4
    completions = [[5] * (1 + i % 3) for i in range(10)]  # lengths 1, 2, 3, 1, 2, 3, ...
    ids = torch.tensor([c + [PAD] * (window - len(c)) for c in completions])
    entropies = torch.ones(10, window)
    entropies[:, 0] = 10.0
    scores = inverted_mask_scores(entropies, ids, ids != PAD, PAD)
    # Partner of row i: the last chunk's row i % 8: row 8 (length 3) for rows 0 and 8, row 9 (length 1) for
    # rows 1 and 9, a padding row (every position) for the others.
    assert scores[0] == scores[8] == 1.0  # positions 3..3
    assert scores[1] == scores[9] == 1.0  # positions 1..3
    assert all(scores[i] == (10 + 3) / 4 for i in range(2, 8))


def test_a_partner_without_padding_gives_nan():
    ids = torch.tensor([[4, 4, 4], [4, PAD, PAD]])
    scores = inverted_mask_scores(torch.ones(2, 3), ids, ids != PAD, PAD)
    assert math.isnan(scores[0]) and scores[1] == 1.0


def test_an_empty_batch_scores_nothing(tiny_policy):
    batch = random_rows(0, 3, 2, 3, tiny_policy.config.vocab_size, False)
    empty = _Batch(*(t[:0] for t in vars(batch).values()))
    assert official_pick_scores(tiny_policy, empty, 3).shape == (0,)

"""The paper preset's loss against the official ExGRPO code's (github.com/ElliottYan/LUFFY at 01f4ae0, in
ExGRPO/): its actor loss written out below as the reference, and our `dr_grpo` with the equivalent entropy
weight."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from exgrpo_pl.step.losses import (
    LossNormaliser,
    compute_grpo_loss,
    compute_importance_weights,
    official_micro_batches,
)
from exgrpo_pl.step.mini_batches import mini_batch_rows

ROOT = "ExGRPO/exgrpo/verl/verl/mix_src"


def official_micro_batch_loss(
    log_prob, old_log_prob, advantages, eos_mask, prefix_mask, entropy, coeff, remove_clip
):
    """One micro-batch's loss as the official script runs it (`loss_remove_token_mean=True`,
    `off_policy_reshape="p_div_p_0.1"`, `on_policy_reshape="no_reshape"`, clip_ratio 0.2, clip_upper_bound
    1.0, gradient_accumulation = ppo_mini_batch_size // ppo_micro_batch_size = 1). `old_log_prob` of an
    off-policy (replayed) row is its recorded behaviour log-prob (mix_trainer_experience.py:421)."""
    adv = advantages.unsqueeze(1).expand_as(log_prob)  # verl's advantages are per token, equal along a row
    negative_approx_kl = log_prob - old_log_prob  # mix_core_alg.py:86
    ratio = torch.exp(negative_approx_kl)  # :90
    on_pg_losses = -adv * ratio  # :116
    if not remove_clip:  # :121-124
        on_pg_losses2 = -adv * torch.clamp(ratio, 1.0 - 0.2, max(1.0, 1.0 + 0.2))  # :117, :122
        on_pg_losses = torch.max(on_pg_losses, on_pg_losses2)
    off_ratio = torch.exp(negative_approx_kl)  # :133
    off_ratio = off_ratio / (off_ratio + 0.1)  # :142-143
    off_pg_losses = -adv * off_ratio  # :189
    prefix = prefix_mask.float()  # :196
    pg_losses = off_pg_losses * prefix + on_pg_losses * (1 - prefix)  # :197
    pg_loss = (pg_losses * eos_mask).sum() / eos_mask.shape[-1]  # :215-216, the padded response width
    entropy_loss = (entropy * eos_mask).sum() / eos_mask.sum()  # mix_actor.py:184
    return pg_loss - entropy_loss * coeff  # mix_actor.py:208, :225 (divided by gradient_accumulation = 1)


def ours(logps, old_logps, behaviour, advantages, mask, replayed, entropy, coef, clip):
    """Our loss on the same rows: `dr_grpo` with max_completion_length = the padded width."""
    normaliser = LossNormaliser(len(logps), int(mask.sum()), mask.shape[1])
    weights = compute_importance_weights(logps, behaviour, mask, "shaping", 0.1)
    loss, _ = compute_grpo_loss(
        logps, old_logps, advantages, mask, normaliser, loss_type="dr_grpo", importance_weights=weights,
        replayed=replayed, entropy=entropy, entropy_coef=coef, clip=clip,
    )  # fmt: skip
    return loss


def test_official_loss_by_hand_with_and_without_clip():
    # Two fresh rows, padded width 3. Row 0: A = 1, r = (1.5, 0.5); row 1: A = -0.5, r = (1, 2, 0.7).
    ratio = torch.tensor([[1.5, 0.5, 1.0], [1.0, 2.0, 0.7]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    logps = old + ratio.log()
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    entropy = torch.ones_like(ratio)
    fresh = torch.zeros(2, dtype=torch.bool)
    # Clipped: -min(rA, clip(r)A) = (-1.2, -0.5) and (0.5, 1.0, 0.4), sum 0.2; unclipped: (-1.5, -0.5, 0.5,
    # 1.0, 0.35), sum -0.15. Each over the width 3, minus 0.001 times the mean entropy 1.
    for remove_clip, expected in ((False, 0.2 / 3 - 0.001), (True, -0.15 / 3 - 0.001)):
        prefix = fresh.unsqueeze(1).expand_as(mask)
        maskf = mask.double()
        official = official_micro_batch_loss(logps, old, adv, maskf, prefix, entropy, 0.001, remove_clip)
        assert abs(float(official) - expected) < 1e-12
        # B = 2 rows, one micro-batch: ours times B, with entropy weight 0.001 * 1 / 2.
        mine = ours(logps, old, old, adv, mask, fresh, entropy, 0.001 / 2, clip=not remove_clip)
        assert abs(2 * float(mine) - expected) < 1e-12


@settings(max_examples=40)
@given(
    micro_batches=st.integers(1, 3),
    rows=st.integers(1, 4),
    width=st.integers(2, 6),
    remove_clip=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_dr_grpo_with_entropy_coef_c_m_over_b_is_the_official_loss_over_b(
    micro_batches, rows, width, remove_clip, seed
):
    """The official mini-batch loss sums its M micro-batches' losses; with equal token counts per micro-batch
    it is B times ours (B rows) when our entropy weight is 0.001 * M / B, gradient included."""
    gen = torch.Generator().manual_seed(seed)
    b = micro_batches * rows
    lengths = torch.randint(1, width + 1, (rows,), generator=gen).repeat(micro_batches)  # equal token counts
    mask = torch.arange(width) < lengths.unsqueeze(1)  # [B, W]
    old = -torch.rand(b, width, generator=gen, dtype=torch.float64) * 3
    behaviour = -torch.rand(b, width, generator=gen, dtype=torch.float64) * 3
    replayed = torch.rand(b, generator=gen) < 0.3
    logps = (old + 0.3 * torch.randn(b, width, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    entropy = torch.rand(b, width, generator=gen, dtype=torch.float64, requires_grad=True)
    # The official old log-prob of a replayed row is its behaviour log-prob.
    official_old = torch.where(replayed.unsqueeze(1), behaviour, old)
    prefix = replayed.unsqueeze(1).expand_as(mask)
    official = summed_official_loss(
        torch.arange(b).chunk(micro_batches), logps, official_old, adv, mask, prefix, entropy, remove_clip
    )
    mine = b * ours(
        logps, old, behaviour, adv, mask, replayed, entropy, 0.001 * micro_batches / b, not remove_clip
    )
    assert torch.allclose(mine, official, atol=1e-12)
    grads = torch.autograd.grad(official, (logps, entropy))
    mine_grads = torch.autograd.grad(mine, (logps, entropy))
    assert all(torch.allclose(a, b_, atol=1e-12) for a, b_ in zip(grads, mine_grads))


def test_mini_batches_deal_groups_in_turn_and_use_every_row_once():
    assert [rows.tolist() for rows in mini_batch_rows(12, 2, 2)] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert [rows.tolist() for rows in mini_batch_rows(6, 4, 2)] == [
        [0, 1, 2, 3],
        [4, 5],
    ]  # a swap step's 6 rows
    assert [rows.tolist() for rows in mini_batch_rows(8, 4, 1)] == [list(range(8))]


def test_fewer_groups_than_updates_is_an_error_naming_the_option():
    with pytest.raises(ValueError, match="steps_per_generation=3: a step has only 2 groups"):
        mini_batch_rows(8, 4, 3)


def official_num_micro_batches(attention_mask_per_rank, max_token_len):
    """verl's `rearrange_micro_batches` (utils/seqlen_balancing.py:223-238, use_dynamic_bsz at
    mix_actor.py:97-99): ceildiv(the mini-batch's attention-mask tokens, max_token_len), then the all-reduce
    MAX over the data-parallel ranks."""
    return max(-(int(mask.sum()) // -max_token_len) for mask in attention_mask_per_rank)


def test_official_micro_batches_by_hand():
    counts = official_micro_batches(torch.tensor([100, 32768, 32769, 98304, 0]), 32768)
    assert counts.tolist() == [1, 1, 2, 3, 1]  # an empty update still runs one micro-batch


@settings(max_examples=40)
@given(
    micro_batches=st.integers(1, 3),
    rows=st.integers(1, 4),
    prompt=st.integers(1, 5),
    width=st.integers(2, 6),
    remove_clip=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_the_bonus_counted_by_the_token_budget_is_the_official_dynamic_batching(
    micro_batches, rows, prompt, width, remove_clip, seed
):
    """With rows of equal length the official micro-batches (however it balances them) hold equal token
    counts, so its mini-batch loss is B times ours with entropy weight 0.001 / B counted M times, M from
    `official_micro_batches`: exact, gradient included."""
    gen = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, width + 1, (), generator=gen))
    b = micro_batches * rows
    tokens = b * (prompt + length)  # the mini-batch's prompt + response tokens on its one rank
    budget = -(-tokens // micro_batches)
    m = official_num_micro_batches([torch.ones(1, tokens)], budget)
    assume(m == micro_batches)  # so that the B rows split into M micro-batches of `rows` rows each
    count = int(official_micro_batches(torch.tensor([tokens]), budget)[0])
    assert count == m
    mask = (torch.arange(width) < length).expand(b, width)  # [B, W]
    old = -torch.rand(b, width, generator=gen, dtype=torch.float64) * 3
    logps = (old + 0.3 * torch.randn(b, width, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    entropy = torch.rand(b, width, generator=gen, dtype=torch.float64, requires_grad=True)
    fresh = torch.zeros(b, dtype=torch.bool)
    prefix = fresh.unsqueeze(1).expand_as(mask)
    parts = torch.randperm(b, generator=gen).view(m, rows)  # any split into M equal micro-batches
    official = summed_official_loss(parts, logps, old, adv, mask, prefix, entropy, remove_clip)
    mine = b * ours(logps, old, old, adv, mask, fresh, entropy, 0.001 / b * count, not remove_clip)
    assert torch.allclose(mine, official, atol=1e-12)
    grads = torch.autograd.grad(official, (logps, entropy))
    mine_grads = torch.autograd.grad(mine, (logps, entropy))
    assert all(torch.allclose(a, b_, atol=1e-12) for a, b_ in zip(grads, mine_grads))


def summed_official_loss(parts, logps, old, adv, mask, prefix, entropy, remove_clip):
    """The official actor loss summed over its micro-batches (`parts`: their rows), entropy weight 0.001."""
    return sum(
        official_micro_batch_loss(
            logps[part],
            old[part],
            adv[part],
            mask[part].double(),
            prefix[part],
            entropy[part],
            0.001,
            remove_clip,
        )  # fmt: skip
        for part in parts
    )

"""exgrpo_pl.step.losses on hand-computed cases, plus properties that must hold for any input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.step.losses import (
    LossNormaliser,
    compute_grpo_loss,
    compute_importance_weights,
    group_advantages,
    masked_mean,
    selective_log_softmax,
    token_entropy,
)


def test_group_advantages_none_is_reward_minus_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4, scale_rewards="none")
    assert torch.allclose(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]))


def test_group_advantages_group_scaling_uses_unbiased_group_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv = group_advantages(rewards, group_size=4, scale_rewards="group", eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 1, 0]
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.5, -0.5]) / std)


def test_group_advantages_batch_scaling_and_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, group_size=2, scale_rewards="batch", eps=0.0)
    assert torch.allclose(adv, torch.tensor([0.0, 0.0, -0.5, 0.5]) / rewards.std())
    assert torch.equal(group_advantages(torch.ones(4), 2, "group"), torch.zeros(4))


def test_group_advantages_rejects_unknown_scaling():
    with pytest.raises(ValueError, match="allowed: group, batch, none"):
        group_advantages(torch.ones(4), 2, "median")


def test_selective_log_softmax_and_entropy_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))  # [1, 1, 3]
    assert torch.allclose(
        selective_log_softmax(logits, torch.tensor([[1]])), torch.log(torch.tensor([[0.25]]))
    )
    expected = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert torch.allclose(token_entropy(logits), torch.tensor([[expected]]))


def test_masked_mean_ignores_padding_and_empty_rows():
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, 9.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.allclose(masked_mean(values, mask, dim=1), torch.tensor([2.0, 0.0]))
    assert masked_mean(values, mask) == 2.0


def test_importance_weights_shaping_truncation_and_padding():
    current = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))  # w = 2, 0.5, 3
    mask = torch.tensor([[True, True, False]])
    shaped = compute_importance_weights(current, behaviour, mask, "shaping", shaping_beta=0.1)
    assert torch.allclose(shaped, torch.tensor([[2 / 2.1, 0.5 / 0.6, 0.0]]))
    truncated = compute_importance_weights(current, behaviour, mask, "truncate", truncation=1.5)
    assert torch.allclose(truncated, torch.tensor([[1.5, 0.5, 0.0]]))
    plain = compute_importance_weights(current, behaviour, mask, "none")
    assert torch.allclose(plain, torch.tensor([[2.0, 0.5, 0.0]]))


def test_shaping_gradient_matches_closed_form():
    # d/dlogp of f(w) = w/(w+b) is b*w/(w+b)^2: the shaping damps tokens the policy already likes.
    logp = torch.log(torch.tensor([[0.6]])).requires_grad_()
    behaviour = torch.log(torch.tensor([[0.3]]))
    weight = compute_importance_weights(logp, behaviour, torch.ones(1, 1, dtype=torch.bool), "shaping", 0.1)
    weight.sum().backward()
    w = 2.0
    assert torch.allclose(logp.grad, torch.tensor([[0.1 * w / (w + 0.1) ** 2]]))


def _toy(n=4, length=3):
    torch.manual_seed(0)
    logps = torch.log(torch.rand(n, length) * 0.9 + 0.05).requires_grad_()
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False], [True, True, True]])
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    return logps, mask[:n], adv[:n]


def test_first_iteration_loss_values_per_loss_type():
    logps, mask, adv = _toy()
    norm = LossNormaliser(num_sequences=4, num_tokens=int(mask.sum()), max_completion_length=3)
    # ratio = 1 everywhere, so per-token loss = -A.
    grpo, _ = compute_grpo_loss(logps, logps.detach(), adv, mask, norm, loss_type="grpo")
    assert torch.allclose(grpo, torch.tensor(-(1.0 - 1.0 + 0.5 + 0.0) / 4))
    dapo, _ = compute_grpo_loss(logps, logps.detach(), adv, mask, norm, loss_type="dapo")
    assert torch.allclose(dapo, torch.tensor(-(2 * 1.0 - 3 * 1.0 + 1 * 0.5) / 9))
    dr, _ = compute_grpo_loss(logps, logps.detach(), adv, mask, norm, loss_type="dr_grpo")
    assert torch.allclose(dr, torch.tensor(-(2 * 1.0 - 3 * 1.0 + 1 * 0.5) / 12))


def test_clipping_counts_and_stops_gradient():
    logps = torch.log(torch.tensor([[0.9], [0.9]])).requires_grad_()
    old = torch.log(torch.tensor([[0.5], [0.5]]))  # ratio 1.8
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 1, dtype=torch.bool)
    loss, stats = compute_grpo_loss(logps, old, adv, mask, LossNormaliser(2, 2, 1), loss_type="dapo")
    loss.backward()
    # A > 0: clipped at 1.2, no gradient; A < 0: min picks the unclipped -1.8 branch, gradient flows.
    assert torch.allclose(loss, torch.tensor((-1.2 + 1.8) / 2))
    assert logps.grad[0, 0] == 0 and logps.grad[1, 0] != 0
    assert torch.allclose(stats["clip_ratio"], torch.tensor(0.5))


def test_replayed_rows_use_importance_weights_without_clipping():
    logps = torch.log(torch.tensor([[0.9], [0.9]])).requires_grad_()
    old = logps.detach()
    behaviour = torch.log(torch.tensor([[0.1], [0.1]]))  # w = 9, far outside any clip range
    mask = torch.ones(2, 1, dtype=torch.bool)
    replayed = torch.tensor([False, True])
    weights = compute_importance_weights(logps, behaviour, mask, "shaping", 0.1)
    loss, stats = compute_grpo_loss(
        logps,
        old,
        torch.tensor([1.0, 1.0]),
        mask,
        LossNormaliser(2, 2, 1),
        importance_weights=weights,
        replayed=replayed,
    )
    assert torch.allclose(loss, torch.tensor((-1.0 - 9 / 9.1) / 2))
    assert torch.allclose(stats["is_weight"], torch.tensor(9 / 9.1))
    with pytest.raises(ValueError, match="importance_weights"):
        compute_grpo_loss(logps, old, torch.ones(2), mask, LossNormaliser(2, 2, 1), replayed=replayed)


def test_kl_and_entropy_terms():
    logps = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    norm = LossNormaliser(1, 1, 1)
    loss, stats = compute_grpo_loss(logps, logps, torch.zeros(1), mask, norm, ref_logps=ref, beta=0.5)
    kl = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1 with d = log(0.25 / 0.5)
    assert torch.allclose(stats["kl"], torch.tensor(kl))
    assert torch.allclose(loss, torch.tensor(0.5 * kl))
    bonus, _ = compute_grpo_loss(
        logps, logps, torch.zeros(1), mask, norm, entropy=torch.tensor([[2.0]]), entropy_coef=0.001
    )
    assert torch.allclose(bonus, torch.tensor(-0.002))


def test_unknown_loss_type_lists_allowed_values():
    logps, mask, adv = _toy()
    with pytest.raises(ValueError, match="allowed: grpo, dr_grpo, dapo"):
        compute_grpo_loss(logps, logps, adv, mask, LossNormaliser(4, 9, 3), loss_type="ppo")


@settings(max_examples=40, deadline=None)
@given(
    loss_type=st.sampled_from(["grpo", "dr_grpo", "dapo"]),
    micro=st.integers(min_value=1, max_value=6),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_micro_batches_add_up_to_the_full_batch_loss(loss_type, micro, seed):
    gen = torch.Generator().manual_seed(seed)
    n, length = 6, 5
    logps = torch.log(torch.rand(n, length, generator=gen) * 0.9 + 0.05)
    old = logps + 0.3 * torch.randn(n, length, generator=gen)
    adv = torch.randn(n, generator=gen)
    mask = torch.rand(n, length, generator=gen) > 0.3
    norm = LossNormaliser(n, int(mask.sum()), length)
    full, _ = compute_grpo_loss(logps, old, adv, mask, norm, loss_type=loss_type)
    parts = sum(
        compute_grpo_loss(
            logps[s : s + micro],
            old[s : s + micro],
            adv[s : s + micro],
            mask[s : s + micro],
            norm,
            loss_type=loss_type,
        )[0]
        for s in range(0, n, micro)
    )
    assert torch.allclose(full, parts, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(w=st.floats(min_value=1e-4, max_value=1e4), beta=st.floats(min_value=1e-3, max_value=10))
def test_shaped_weight_is_bounded_and_monotone(w, beta):
    logp = torch.tensor([[math.log(w)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    f = compute_importance_weights(logp, torch.zeros(1, 1, dtype=torch.float64), mask, "shaping", beta)
    f2 = compute_importance_weights(logp + 0.1, torch.zeros(1, 1, dtype=torch.float64), mask, "shaping", beta)
    assert 0 < f.item() < 1 and f2.item() >= f.item()

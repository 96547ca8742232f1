"""exgrpo_pl.step.losses on hand-computed cases, plus properties that must hold for any input."""

import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exgrpo_pl.step.losses import (
    LOSS_TYPES,
    LossNormaliser,
    batch_std,
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


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_replayed_share_weighs_each_token_by_its_slope_in_the_loss(loss_type):
    # One fresh and one replayed row of one token, A = 1 and 2, w = 1: the fresh token's slope is r A = 1,
    # the replayed one's is A d f(w) / d log w = 2 beta w / (w + beta)^2 (not f(w) = 1 / 1.1).
    logps = torch.log(torch.tensor([[0.5], [0.5]])).requires_grad_()
    mask = torch.ones(2, 1, dtype=torch.bool)
    replayed = torch.tensor([False, True])
    weights = compute_importance_weights(logps, logps.detach(), mask, "shaping", 0.1)
    _, stats = compute_grpo_loss(
        logps, logps.detach(), torch.tensor([1.0, 2.0]), mask, LossNormaliser(2, 2, 1),
        loss_type=loss_type, importance_weights=weights, replayed=replayed, weigh_replayed=True,
    )  # fmt: skip
    slope = 2 * 0.1 / 1.1**2
    assert float(stats["replayed_pg_weight"] / stats["pg_weight"]) == pytest.approx(slope / (1 + slope))
    assert logps.grad is None  # the weights' backward leaves the loss's own to the caller
    _, plain = compute_grpo_loss(logps, logps.detach(), torch.ones(2), mask, LossNormaliser(2, 2, 1))
    assert "pg_weight" not in plain


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


@settings(max_examples=40)
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


@settings(max_examples=40)
@given(w=st.floats(min_value=1e-4, max_value=1e4), beta=st.floats(min_value=1e-3, max_value=10))
def test_shaped_weight_is_bounded_and_monotone(w, beta):
    logp = torch.tensor([[math.log(w)]], dtype=torch.float64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    f = compute_importance_weights(logp, torch.zeros(1, 1, dtype=torch.float64), mask, "shaping", beta)
    f2 = compute_importance_weights(logp + 0.1, torch.zeros(1, 1, dtype=torch.float64), mask, "shaping", beta)
    assert 0 < f.item() < 1 and f2.item() >= f.item()


def on_ranks(parts, fn):
    """`fn(part, sum_over_ranks)` run for each part in its own thread, as ranks would run it: `sum_over_ranks`
    is an all-reduce (sum) among the threads. Returns each rank's result."""
    slots, results = [None] * len(parts), [None] * len(parts)
    barrier = threading.Barrier(len(parts))

    def rank(r):
        def sum_over_ranks(tensor):
            slots[r] = tensor
            barrier.wait()
            total = sum(slots)
            barrier.wait()  # every rank has read the slots before any writes its next collective
            return total

        results[r] = fn(parts[r], sum_over_ranks)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(parts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


@settings(max_examples=30)
@given(
    groups=st.lists(st.integers(min_value=1, max_value=3), min_size=2, max_size=4),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_batch_scaling_on_ranks_divides_by_the_std_of_every_ranks_rewards(groups, seed):
    """Rank r holds groups[r] groups of 4 rewards, each rank on its own scale."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.rand(4 * g, generator=gen, dtype=torch.float64) * (r + 1) for r, g in enumerate(groups)]
    ranks = on_ranks(parts, lambda part, reduce: group_advantages(part, 4, "batch", 0.0, reduce))
    whole = group_advantages(torch.cat(parts), 4, "batch", eps=0.0)
    assert torch.allclose(torch.cat(ranks), whole, rtol=1e-12, atol=1e-12)
    stds = on_ranks(parts, batch_std)
    assert all(torch.allclose(std, torch.cat(parts).std(), rtol=1e-12) for std in stds)


def _batch(seed, n=8, length=5):
    """float64 log-probs (with grad), old and reference log-probs, behaviour log-probs, advantages, a mask
    with rows of every length 0..length, and token entropies (with grad)."""
    gen = torch.Generator().manual_seed(seed)
    logps = torch.log(torch.rand(n, length, generator=gen, dtype=torch.float64) * 0.9 + 0.05).requires_grad_()
    old, ref, behaviour = (logps.detach() + 0.3 * torch.randn(n, length, generator=gen) for _ in range(3))
    lengths = torch.randint(0, length + 1, (n,), generator=gen)
    mask = torch.arange(length) < lengths.unsqueeze(1)
    entropy = torch.rand(n, length, generator=gen, dtype=torch.float64).requires_grad_()
    return logps, old, ref, behaviour, torch.randn(n, generator=gen, dtype=torch.float64), mask, entropy


@settings(max_examples=60)
@given(
    loss_type=st.sampled_from(LOSS_TYPES),
    level=st.sampled_from(["token", "sequence"]),
    cuts=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=3, unique=True),
    micro=st.integers(min_value=1, max_value=8),
    delta=st.sampled_from([None, 1.5]),
    seed=st.integers(min_value=0, max_value=10_000),
)
def test_ranks_average_to_the_gradient_of_their_whole_batch(loss_type, level, cuts, micro, delta, seed):
    """Rows split at `cuts` over ranks (unequal rows and tokens), each rank's micro-batches backward with the
    whole batch's counts; DDP's average of the ranks' gradients is the one-process gradient."""
    logps, old, ref, behaviour, adv, mask, entropy = _batch(seed)
    replayed = torch.arange(len(adv)) % 3 == 0
    options = dict(
        loss_type=loss_type, importance_sampling_level=level, delta=delta, epsilon_high=0.28, beta=0.04,
        entropy_coef=0.01,
    )  # fmt: skip

    def loss(rows, normaliser):
        weights = compute_importance_weights(logps[rows], behaviour[rows], mask[rows], level=level)
        return compute_grpo_loss(
            logps[rows], old[rows], adv[rows], mask[rows], normaliser, importance_weights=weights,
            replayed=replayed[rows], ref_logps=ref[rows], entropy=entropy[rows], **options,
        )[0]  # fmt: skip

    n = len(adv)
    whole = LossNormaliser(n, int(mask.sum()), 5)
    loss(slice(None), whole).backward()
    expected = logps.grad.clone(), entropy.grad.clone()
    logps.grad, entropy.grad = None, None
    bounds = [0, *sorted(cuts), n]
    ranks = LossNormaliser(n, int(mask.sum()), 5, world_size=len(bounds) - 1)
    for start, stop in zip(bounds, bounds[1:]):
        for first in range(start, stop, micro):
            loss(slice(first, min(first + micro, stop)), ranks).backward()
    averaged = logps.grad / ranks.world_size, entropy.grad / ranks.world_size  # DDP's mean over ranks
    for got, want in zip(averaged, expected):
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-14)


def test_sequence_level_ratio_is_the_exp_of_the_mean_token_log_ratio():
    logps = torch.log(torch.tensor([[0.6, 0.3, 0.5]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([[0.5, 0.3, 0.9]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False]])  # the third token is padding: not in the mean
    loss, _ = compute_grpo_loss(
        logps, old, torch.tensor([1.0], dtype=torch.float64), mask, LossNormaliser(1, 2, 3),
        loss_type="grpo", importance_sampling_level="sequence",
    )  # fmt: skip
    ratio = math.exp((math.log(0.6 / 0.5) + 0.0) / 2)  # 1.095, inside [0.8, 1.2]
    assert torch.allclose(loss, torch.tensor(-ratio, dtype=torch.float64))
    loss.backward()  # d(-r)/d logp_t = -r / 2 for both real tokens, 0 on padding
    assert torch.allclose(logps.grad, torch.tensor([[-ratio / 2, -ratio / 2, 0.0]], dtype=torch.float64))
    weights = compute_importance_weights(
        logps.detach(), old, mask, correction="shaping", shaping_beta=0.1, level="sequence"
    )
    shaped = ratio / (ratio + 0.1)  # one shaped weight for every real token of the row
    assert torch.allclose(weights, torch.tensor([[shaped, shaped, 0.0]], dtype=torch.float64))


def test_delta_caps_the_unclipped_ratio_of_negative_advantages():
    logps = torch.log(torch.tensor([[0.9]])).requires_grad_()
    old = torch.log(torch.tensor([[0.3]]))  # ratio 3
    mask, norm = torch.ones(1, 1, dtype=torch.bool), LossNormaliser(1, 1, 1)
    plain, _ = compute_grpo_loss(logps, old, torch.tensor([-1.0]), mask, norm)
    capped, stats = compute_grpo_loss(logps, old, torch.tensor([-1.0]), mask, norm, delta=2.0)
    assert torch.allclose(plain, torch.tensor(3.0)) and torch.allclose(capped, torch.tensor(2.0))
    capped.backward()
    assert logps.grad.item() == 0  # past delta the token no longer pushes
    assert stats["clip_ratio"] == 0  # the min took the (capped) unclipped branch


def test_bias_corrected_kl_has_the_ratio_in_its_gradient():
    logps = torch.log(torch.tensor([[0.5]], dtype=torch.float64)).requires_grad_()
    ref = torch.log(torch.tensor([[0.25]], dtype=torch.float64))
    mask, norm = torch.ones(1, 1, dtype=torch.bool), LossNormaliser(1, 1, 1)
    kl = 0.5 - math.log(0.5) - 1  # exp(d) - d - 1, d = log(0.25 / 0.5)
    grads = {}
    for corrected in (False, True):
        logps.grad = None
        loss, _ = compute_grpo_loss(
            logps, logps.detach(), torch.zeros(1, dtype=torch.float64), mask, norm, ref_logps=ref, beta=1.0,
            use_bias_correction_kl=corrected,
        )  # fmt: skip
        assert torch.allclose(loss, torch.tensor(kl, dtype=torch.float64))  # r = 1: the same value
        loss.backward()
        grads[corrected] = logps.grad.item()
    # d kl / d logp = 1 - exp(d) = 0.5; with r = exp(logp - old) the product rule adds kl * r = kl.
    assert math.isclose(grads[False], 0.5) and math.isclose(grads[True], 0.5 + kl)


def test_entropy_bonus_is_the_token_mean_for_every_loss_type():
    mask = torch.tensor([[True, False, False], [True, True, True]])  # 1 and 3 tokens
    entropy = torch.tensor([[2.0, 9.0, 9.0], [1.0, 1.0, 1.0]])
    logps = torch.zeros(2, 3)
    norm = LossNormaliser(2, 4, 3)
    for loss_type in LOSS_TYPES:
        loss, _ = compute_grpo_loss(
            logps, logps, torch.zeros(2), mask, norm, loss_type=loss_type, entropy=entropy, entropy_coef=0.1
        )
        assert torch.allclose(loss, torch.tensor(-0.1 * (2.0 + 3.0) / 4)), loss_type


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_replayed_rows_keep_their_shaped_weight_under_delta_at_either_level(level):
    """delta and the clip range act on fresh rows' ratio; a replayed row's term stays -f(w) A, with w the
    token's or (GSPO) the sequence's ratio to the behaviour policy."""
    logps = torch.log(torch.tensor([[0.9, 0.6], [0.9, 0.6]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([[0.3, 0.3], [0.3, 0.3]], dtype=torch.float64))  # fresh ratios 3 and 2
    behaviour = torch.log(torch.tensor([[0.1, 0.2], [0.1, 0.2]], dtype=torch.float64))  # w = 9 and 3
    mask = torch.ones(2, 2, dtype=torch.bool)
    replayed = torch.tensor([False, True])
    weights = compute_importance_weights(logps, behaviour, mask, "shaping", 0.1, level=level)
    loss, _ = compute_grpo_loss(
        logps, old, torch.tensor([-1.0, 1.0], dtype=torch.float64), mask, LossNormaliser(2, 4, 2),
        delta=1.5, importance_sampling_level=level, importance_weights=weights, replayed=replayed,
    )  # fmt: skip
    w = torch.tensor([9.0, 3.0], dtype=torch.float64)
    if level == "sequence":
        w = w.log().mean().exp().expand(2)  # sqrt(27)
    fresh = [1.5, 1.5]  # A < 0: -min(min(r, 1.5) A, clip(r) A) = 1.5 for r = 3 and r = 2 (and for sqrt(6))
    expected = (sum(fresh) - (w / (w + 0.1)).sum()) / 4
    assert torch.allclose(loss, expected)

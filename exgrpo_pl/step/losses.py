"""The GRPO / ExGRPO math as pure functions: advantages, importance weights, the policy loss.

Nothing here knows about models, buffers or Lightning, so every function is tested on hand-computed cases
(tests/step/test_losses.py). Shapes: N rollouts, L completion tokens, K rollouts per question (group size).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
OFF_POLICY_CORRECTIONS = ("shaping", "truncate", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

SumOverRanks = Callable[[Tensor], Tensor]
"""Sums a tensor over every rank of the run (an all-reduce); the identity on one rank."""


def group_advantages(
    rewards: Tensor,
    group_size: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    sum_over_ranks: SumOverRanks | None = None,
) -> Tensor:
    """A = r - mean(r of its group), optionally divided by a standard deviation.

    Args:
        rewards: `[N]` with N a multiple of `group_size`; groups are contiguous rows.
        group_size: K, rollouts per question.
        scale_rewards: "group" divides by the group's std (GRPO), "batch" by the std of all rewards,
            "none" keeps the raw centred reward (Dr. GRPO, and the ExGRPO paper).
        eps: added to the std so zero-variance groups give zero advantage, not NaN.
        sum_over_ranks: under data parallelism, sums over the ranks, so that "batch" takes the std of every
            rank's rewards (as TRL gathers them); None: `rewards` is the whole batch.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r}; allowed: {', '.join(SCALE_REWARDS)}")
    grouped = rewards.view(-1, group_size)  # [N/K, K]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [N/K, K]
    if scale_rewards == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)  # std is nan for K=1, never used so
    elif scale_rewards == "batch":
        centred = centred / (batch_std(rewards, sum_over_ranks) + eps)
    return centred.reshape(-1)  # [N]


def batch_std(values: Tensor, sum_over_ranks: SumOverRanks | None = None) -> Tensor:
    """The unbiased standard deviation of `values` pooled over every rank. `[n]` -> `[]`.

    Two passes (the mean, then the squared deviations from it), each one all-reduce of a sum, so it is the
    std of the concatenated rewards of all ranks to rounding, whatever each rank holds.

    Args:
        values: `[n]` this rank's values.
        sum_over_ranks: sums a tensor over the ranks; None: `values` are all there are.
    """
    if sum_over_ranks is None:
        return values.std()
    count_and_sum = sum_over_ranks(torch.stack([values.new_tensor(values.numel()), values.sum()]))  # [2]
    count = count_and_sum[0]
    mean = count_and_sum[1] / count
    squares = sum_over_ranks((values - mean).square().sum())  # []
    return (squares / (count - 1)).sqrt()


def selective_log_softmax(logits: Tensor, token_ids: Tensor) -> Tensor:
    """log softmax(logits)[token] without the full log-softmax tensor. `[N, L, V]`, `[N, L]` -> `[N, L]`."""
    picked = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [N, L]
    return picked - torch.logsumexp(logits, dim=-1)  # [N, L]


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at every position. `[N, L, V]` -> `[N, L]`.

    Computed in float32 (float64 for float64 logits).
    """
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [N, L, V]
    if logp.requires_grad:
        return -(logp.exp() * logp).sum(-1)  # [N, L]
    return -logp.exp().mul_(logp).sum(-1)  # [N, L] no graph to keep: one float32 copy of the logits fewer


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` where `mask` is True; 0 where nothing is masked in."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def compute_importance_weights(
    current_logps: Tensor,
    behaviour_logps: Tensor,
    mask: Tensor,
    correction: str = "shaping",
    shaping_beta: float = 0.1,
    truncation: float = 2.0,
    level: str = "token",
) -> Tensor:
    """Per-token weights for replayed (off-policy) tokens, differentiable through `current_logps`.

    w = pi_theta / pi_behaviour per token; the behaviour log-probs were stored with the trajectory when it
    was generated, so no copy of the old policy is needed.

    Args:
        current_logps: `[N, L]` log-probs under the current policy (with grad).
        behaviour_logps: `[N, L]` log-probs under the policy that generated the tokens.
        mask: `[N, L]` bool, real completion tokens.
        correction: "shaping" gives f(w) = w / (w + beta) (ExGRPO's policy shaping: it damps the gradient
            of tokens the current policy already finds likely, so replay cannot collapse entropy);
            "truncate" gives min(w, truncation) (truncated IS); "none" gives w.
        shaping_beta: beta of policy shaping; the paper uses 0.1.
        truncation: the cap of truncated IS.
        level: "token" gives each token its own w; "sequence" (GSPO) gives every token of a row
            w = exp(mean over its tokens of log pi_theta - log pi_behaviour), the correction then shaping or
            truncating that one ratio.

    Returns:
        `[N, L]` weights, 0 on padding.
    """
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(f"correction={correction!r}; allowed: {', '.join(OFF_POLICY_CORRECTIONS)}")
    log_w = sequence_level(current_logps - behaviour_logps, mask, level)  # [N, L]
    # Clamp the log-ratio so one wild token cannot overflow exp(); 20 nats is far past any useful weight.
    w = torch.exp(log_w.clamp(-20.0, 20.0))  # [N, L]
    if correction == "shaping":
        w = w / (w + shaping_beta)
    elif correction == "truncate":
        w = w.clamp(max=truncation)
    return w * mask  # [N, L]


def sequence_level(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """`log_ratio` `[N, L]` as it is ("token"), or each row's mean over its `mask`ed tokens broadcast to all
    its tokens ("sequence", GSPO's length-normalised sequence ratio, as TRL computes it)."""
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(
            f"importance_sampling_level={level!r}; allowed: {', '.join(IMPORTANCE_SAMPLING_LEVELS)}"
        )
    if level == "token":
        return log_ratio
    return masked_mean(log_ratio, mask, dim=1).unsqueeze(1).expand_as(log_ratio)  # [N, L]


def replayed_terms(
    per_token: Tensor,
    importance_weights: Tensor,
    advantages: Tensor,
    replayed: Tensor,
    mask: Tensor,
    stats: dict[str, Tensor] | None = None,
) -> Tensor:
    """`per_token` `[N, L]` with each replayed row's terms replaced by ExGRPO's -f(w) A.

    The one place the replayed term is written: `compute_grpo_loss` and
    `exgrpo_pl.step.groups.replayed_token_loss` (a module's own loss, `ReplayMixin.replay_loss`) both use it.

    Args:
        per_token: `[N, L]` the on-policy per-token loss.
        importance_weights: `[N, L]` f(w) from `compute_importance_weights`, with grad.
        advantages: `[N]`.
        replayed: `[N]` bool, rows that came out of the buffer.
        mask: `[N, L]` bool, the tokens the `is_weight` statistic averages over.
        stats: receives `is_weight`, the mean f(w) over the replayed rows' masked tokens (detached).
    """
    off = replayed.unsqueeze(1)  # [N, 1]
    if stats is not None:
        stats["is_weight"] = masked_mean(importance_weights.detach(), mask & off)
    adv = advantages.unsqueeze(1).to(importance_weights.dtype)  # [N, 1]
    return torch.where(off, -importance_weights * adv, per_token)  # [N, L]


@dataclass
class LossNormaliser:
    """Denominators of the whole batch, so micro-batched losses add up to the full-batch loss exactly, and
    the ranks' losses to the loss of all ranks' rows.

    Under data parallelism each rank holds part of the batch and DDP (or DeepSpeed) averages the ranks'
    gradients. The counts are then those of every rank together and `world_size` the number of ranks: each
    rank's loss is its rows' share of the whole batch's loss times `world_size`, so the average of the ranks'
    gradients is the gradient of the whole batch, whatever each rank's token count.

    Args:
        num_sequences: rollouts in the whole batch (all ranks).
        num_tokens: real (unmasked) completion tokens in the whole batch (all ranks).
        max_completion_length: the generation budget, Dr. GRPO's constant normaliser.
        world_size: ranks whose gradients are averaged (1 without data parallelism).
    """

    num_sequences: int
    num_tokens: int
    max_completion_length: int
    world_size: int = 1


def compute_grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    normaliser: LossNormaliser,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    importance_weights: Tensor | None = None,
    replayed: Tensor | None = None,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
    use_bias_correction_kl: bool = True,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    clip: bool = True,
    weigh_replayed: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO surrogate, with ExGRPO's weighted objective on replayed rows (TRL's `_compute_loss`).

    On-policy rows: -min(r' A, clip(r, 1-eps_low, 1+eps_high) A) with r = exp(logps - old_logps) per token
    (or GSPO's sequence ratio) and r' = min(r, delta) when `delta` is set (two-sided clipping), else r.
    Replayed rows: -f(w) A with f(w) from `compute_importance_weights` and no clipping (the paper's
    mixed-policy objective; `delta` is not applied to them, `is_truncation` caps w there). A k3 KL to a
    reference is added per token (times r when `use_bias_correction_kl`), and the whole is reduced by the loss
    type's normaliser; the entropy bonus is then subtracted as a token mean, the same for every loss type.

    Args:
        logps: `[N, L]` current log-probs (with grad).
        old_logps: `[N, L]` log-probs at generation time (detached); equal to `logps` on the first
            iteration, which makes r = 1 with the right gradient.
        advantages: `[N]`.
        mask: `[N, L]` bool, tokens that count in the loss.
        normaliser: whole-batch denominators (see `LossNormaliser`).
        loss_type: "grpo" averages tokens per sequence then sequences; "dr_grpo" divides the token sum by
            num_sequences * max_completion_length; "dapo" divides it by the batch's token count.
        epsilon_low: lower clipping range of r.
        epsilon_high: upper clipping range of r (0 allowed: no increase of a token's probability is rewarded).
        delta: upper bound of the unclipped ratio (INTELLECT-2's two-sided clipping); None: none.
        importance_sampling_level: "token" (one ratio per token) or "sequence" (GSPO: every token of a row
            has exp(the mean of its tokens' log-ratios)); replayed rows' weights are made at the same level
            by `compute_importance_weights`.
        importance_weights: `[N, L]` f(w) for replayed rows; required when `replayed` has a True row.
        replayed: `[N]` bool, rows that came out of the buffer.
        ref_logps: `[N, L]` reference-policy log-probs; used when `beta > 0`.
        beta: weight of the KL.
        use_bias_correction_kl: multiply each token's KL estimate by r (before `delta`), which makes its
            gradient the unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default).
        entropy: `[N, L]` token entropy (with grad); used when `entropy_coef > 0`.
        entropy_coef: the loss is lowered by this times the mean entropy of the whole batch's masked tokens.
        clip: False drops the clipping of on-policy rows: their term is -r' A (the official ExGRPO code's
            `loss_remove_clip`, which it applies once replay has started).
        weigh_replayed: add `pg_weight` and `replayed_pg_weight` to the statistics (when `logps` has a
            gradient): the sum of |d loss / d logps| over every masked token and over the replayed rows'
            ones, for the policy-gradient part of the loss (KL and entropy bonus left out), so their ratio
            is the share of the update that replayed rows drive (`PolicyUpdate` logs it).

    Returns:
        The scalar loss and detached statistics: clip_ratio (share of on-policy tokens clipped), kl,
            is_weight (mean f(w) over replayed tokens).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")
    maskf = mask.to(logps.dtype)  # [N, L]
    adv = advantages.unsqueeze(1)  # [N, 1]
    ratio = torch.exp(sequence_level(logps - old_logps, mask, importance_sampling_level))  # [N, L]
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)  # [N, L]
    unclipped = ratio if delta is None else ratio.clamp(max=delta)  # [N, L]
    if clip:
        per_token = -torch.min(unclipped * adv, clipped * adv)  # [N, L]
        is_clipped = (unclipped * adv) > (clipped * adv)  # [N, L] the min picked the clipped branch
    else:
        per_token = -unclipped * adv  # [N, L]
        is_clipped = torch.zeros_like(mask)  # [N, L]

    stats: dict[str, Tensor] = {}
    if replayed is not None and bool(replayed.any()):
        if importance_weights is None:
            raise ValueError("compute_grpo_loss: replayed rows need importance_weights")
        per_token = replayed_terms(per_token, importance_weights, advantages, replayed, mask, stats)
        off = replayed.unsqueeze(1)  # [N, 1]
        is_clipped = is_clipped & ~off
        on_mask = mask & ~off
    else:
        on_mask = mask
    stats["clip_ratio"] = masked_mean(is_clipped.to(logps.dtype), on_mask).detach()

    if weigh_replayed and logps.requires_grad:
        # An extra backward through the elementwise terms only (it stops at `logps`): f(w)'s slope, not f(w),
        # is what a replayed token weighs in the gradient (shaping's w / (w + beta) is nearly flat at w = 1).
        (slopes,) = torch.autograd.grad(
            _reduce(per_token, maskf, normaliser, loss_type), logps, retain_graph=True
        )
        weights = slopes.detach().abs() * maskf  # [N, L]
        stats["pg_weight"] = weights.sum()
        off = replayed.unsqueeze(1) if replayed is not None else torch.zeros_like(mask[:, :1])
        stats["replayed_pg_weight"] = (weights * off).sum()

    if beta > 0.0:
        if ref_logps is None:
            raise ValueError("compute_grpo_loss: beta > 0 needs ref_logps")
        log_ref_ratio = ref_logps - logps  # [N, L]
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # [N, L] k3 estimator, always >= 0
        stats["kl"] = masked_mean(kl.detach(), mask)
        per_token = per_token + beta * (kl * ratio if use_bias_correction_kl else kl)

    loss = _reduce(per_token, maskf, normaliser, loss_type)
    if entropy_coef > 0.0:
        if entropy is None:
            raise ValueError("compute_grpo_loss: entropy_coef > 0 needs entropy")
        # A bonus: higher entropy lowers the loss. A token mean whatever the loss type, as TRL's.
        loss = loss - entropy_coef * (entropy * maskf).sum() / max(normaliser.num_tokens, 1)
    return loss * normaliser.world_size, stats


def official_micro_batches(tokens: Tensor, budget: int) -> Tensor:
    """How many micro-batches the official ExGRPO code splits each update into on this rank: its dynamic
    batching (`use_dynamic_bsz`) packs an update's rows into ceil(prompt + response tokens / budget) of
    them, and sums the entropy bonus's token mean over them, so the bonus counts that many times.

    Args:
        tokens: `[U]` prompt + completion tokens of each of a step's U updates on this rank.
        budget: tokens per micro-batch (its `ppo_max_token_len_per_gpu`, 32768 in its script).

    Returns:
        `[U]` long, at least 1; under data parallelism the official code takes the largest over the ranks.
    """
    return (-(-tokens.long() // budget)).clamp(min=1)  # [U]


def _reduce(per_token: Tensor, maskf: Tensor, normaliser: LossNormaliser, loss_type: str) -> Tensor:
    """The loss type's reduction of `[N, L]` per-token terms over the masked tokens (`maskf`)."""
    if loss_type == "grpo":
        per_seq = (per_token * maskf).sum(1) / maskf.sum(1).clamp(min=1)  # [N]
        return per_seq.sum() / normaliser.num_sequences
    if loss_type == "dr_grpo":
        return (per_token * maskf).sum() / (normaliser.num_sequences * normaliser.max_completion_length)
    return (per_token * maskf).sum() / max(normaliser.num_tokens, 1)

"""What a step's first forward gives its groups, and what the loss does with replayed rows: the fresh rows'
behaviour log-probs and entropy (`record_behaviour`), and the replayed rows' importance-weighted token terms
(`replayed_token_loss`).

Part of `exgrpo_pl.step.groups` (see there for the whole step); plain PyTorch, no Lightning and no model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.step.losses import compute_importance_weights, masked_mean, replayed_terms, token_entropy


@torch.no_grad()
def record_behaviour(
    rollouts: RolloutBatch, logps: Tensor, logits: Tensor, rows: slice = slice(None)
) -> None:
    """Give the fresh rows the behaviour log-probs and entropy of the step's first forward (in place).

    Call it with the forward taken before any update on this batch: its log-probs are those of the policy
    that sampled the rows, which the importance weights of a later replay divide by, and its entropy is
    what the buffer ranks trajectories by. Replayed rows keep what they carry.

    Args:
        rollouts: the step's rows (`sample_groups` / `assemble_groups`).
        logps: `[n, C]` log-probs of the completion tokens from that forward.
        logits: `[n, C, V]` the logits that predicted them, divided by the sampling temperature as the
            sampler did; or `[n, C]` token entropies.
        rows: the rows of `rollouts` the forward took, when it took a micro-batch (default: all N).
    """
    mask = rollouts.completion_mask[rows]
    if logps.shape != mask.shape or logits.shape[:2] != mask.shape:
        raise ValueError(
            f"record_behaviour: logps {list(logps.shape)} and logits {list(logits.shape)} must be [n, C] and "
            f"[n, C, V] with [n, C] = completion_ids[rows]' {list(mask.shape)}"
        )
    fresh = ~rollouts.replayed[rows]
    if not bool(fresh.any()):
        return
    scored = logps.detach().float().masked_fill(~mask, 0.0)  # [n, C]
    rollouts.behaviour_logps[rows] = torch.where(fresh.unsqueeze(1), scored, rollouts.behaviour_logps[rows])
    entropy = token_entropy(logits.detach()) if logits.ndim == 3 else logits.detach().float()  # [n, C]
    rollouts.entropy[rows] = torch.where(fresh, masked_mean(entropy, mask, dim=1), rollouts.entropy[rows])


def replayed_token_loss(
    per_token: Tensor,
    logps: Tensor,
    rollouts: RolloutBatch,
    correction: str = "shaping",
    shaping_beta: float = 0.1,
    truncation: float = 2.0,
    stats: dict[str, Tensor] | None = None,
    rows: slice = slice(None),
    level: str = "token",
) -> Tensor:
    """`per_token` `[n, C]` with each replayed row's terms replaced by ExGRPO's -f(w) A.

    A replayed row was sampled by an older policy, so the clipped ratio against this step's own log-probs
    says nothing about it; ExGRPO weights its tokens by f(w), w = pi_theta / pi_behaviour from the stored
    behaviour log-probs, unclipped (`compute_importance_weights`: policy shaping w / (w + beta) by
    default; `exgrpo_pl.step.losses.replayed_terms`, which `compute_grpo_loss` uses too). Fresh rows keep
    their terms; without replayed rows `per_token` is returned as it is.

    Args:
        per_token: `[n, C]` the module's per-token loss (e.g. the clipped surrogate).
        logps: `[n, C]` current log-probs of the completion tokens, with grad.
        rollouts: the step's rows: `replayed`, `behaviour_logps`, `advantages`, `completion_mask`.
        correction: as for `compute_importance_weights`.
        shaping_beta: as for `compute_importance_weights`.
        truncation: as for `compute_importance_weights`.
        stats: when given and there are replayed rows, receives `is_weight`, the mean f(w) over their
            completion tokens (detached; `ExGRPOModule` logs the same as `train/is_weight`).
        rows: the rows of `rollouts` that `per_token` and `logps` are of, for a micro-batch (default: all N).
        level: "token" or "sequence" (GSPO's ratio per completion), as for `compute_importance_weights`.
    """
    replayed = rollouts.replayed[rows]
    if not bool(replayed.any()):
        return per_token
    mask = rollouts.completion_mask[rows]
    weights = compute_importance_weights(
        logps, rollouts.behaviour_logps[rows], mask, correction, shaping_beta, truncation, level
    )  # [n, C]
    return replayed_terms(per_token, weights, rollouts.advantages[rows], replayed, mask, stats)

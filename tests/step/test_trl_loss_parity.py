"""Our loss against TRL's: `GRPOTrainer._compute_loss` itself (TRL's code, unchanged, on a stand-in trainer
that supplies the per-token log-probs and entropies) and `compute_grpo_loss` on identical float64 inputs, for
every combination of loss options both have. Losses and gradients agree to rounding.

12 rows in groups of 4, completion lengths 0-7, advantages from `group_advantages` (fed to both), clipped and
unclipped tokens; the first iteration (old log-probs = current) and a later one; the batch in one piece and
in micro-batches of equal size (TRL's gradient accumulation). TRL's entropy bonus is each micro-batch's token
mean, ours the whole batch's: the two are compared on one micro-batch. Marked slow: TRL comes with the
`bench` extra, which the slow CI step installs.
"""

import itertools
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from exgrpo_pl.step.losses import LOSS_TYPES, LossNormaliser, compute_grpo_loss, group_advantages

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

pytestmark = pytest.mark.slow

N, K, L = 12, 4, 7


def inputs(seed, later_iteration):
    gen = torch.Generator().manual_seed(seed)
    logps = torch.log(torch.rand(N, L, generator=gen, dtype=torch.float64) * 0.9 + 0.05).requires_grad_()
    # A later iteration's old log-probs differ by up to ~0.4 nats: many ratios leave [0.8, 1.28].
    old = logps.detach() + 0.4 * torch.randn(N, L, generator=gen, dtype=torch.float64)
    ref = logps.detach() + 0.3 * torch.randn(N, L, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, L + 1, (N,), generator=gen)
    mask = (torch.arange(L) < lengths.unsqueeze(1)).long()
    entropy = torch.rand(N, L, generator=gen, dtype=torch.float64).requires_grad_()
    rewards = torch.randint(0, 3, (N,), generator=gen).double()
    return logps, old if later_iteration else None, ref, mask, entropy, rewards


def trl_loss(options, logps, old, ref, mask, entropy, advantages, rows, micro_batches):
    """TRL's `_compute_loss` on the rows of one micro-batch, `micro_batches` of them accumulated."""
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps[rows], entropy[rows], None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False, aux_loss_enabled=False,
        importance_sampling_level=options["importance_sampling_level"], beta=options["beta"],
        loss_type=options["loss_type"], epsilon_low=options["epsilon_low"], max_completion_length=L,
        epsilon_high=options["epsilon_low"] if options["epsilon_high"] is None else options["epsilon_high"],
        args=SimpleNamespace(
            use_bias_correction_kl=options["use_bias_correction_kl"], delta=options["delta"],
            steps_per_generation=micro_batches,
        ),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=micro_batches,
        accelerator=SimpleNamespace(
            num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x, sync_gradients=True
        ),
        entropy_coef=options["entropy_coef"], _entropy_bonus_enabled=options["entropy_coef"] != 0,
        use_adaptive_entropy=False, _metrics=defaultdict(lambda: defaultdict(list)),
    )  # fmt: skip
    batch = {
        "prompt_ids": torch.ones(N, 2, dtype=torch.long)[rows], "prompt_mask": torch.ones(N, 2)[rows],
        "completion_ids": torch.ones(N, L, dtype=torch.long)[rows], "completion_mask": mask[rows],
        "advantages": advantages[rows], "ref_per_token_logps": ref[rows],
        "old_per_token_logps": None if old is None else old[rows], "num_items_in_batch": mask.sum(),
    }  # fmt: skip
    return grpo_trainer.GRPOTrainer._compute_loss(trainer, None, batch)


def our_loss(options, logps, old, ref, mask, entropy, advantages, rows, micro_batches):
    normaliser = LossNormaliser(N, int(mask.sum()), L)
    epsilon_high = options["epsilon_low"] if options["epsilon_high"] is None else options["epsilon_high"]
    old_rows = logps[rows].detach() if old is None else old[rows]
    return compute_grpo_loss(
        logps[rows], old_rows, advantages[rows], mask[rows].bool(), normaliser,
        loss_type=options["loss_type"], epsilon_low=options["epsilon_low"], epsilon_high=epsilon_high,
        delta=options["delta"], importance_sampling_level=options["importance_sampling_level"],
        ref_logps=ref[rows], beta=options["beta"], use_bias_correction_kl=options["use_bias_correction_kl"],
        entropy=entropy[rows], entropy_coef=options["entropy_coef"],
    )[0]  # fmt: skip


def loss_and_grads(loss, options, tensors, micro):
    """The sum of `loss` over the micro-batches of `micro` rows, and its gradients (log-probs, entropies)."""
    logps, entropy = tensors[0], tensors[4]
    logps.grad = entropy.grad = None
    total = sum(
        loss(options, *tensors, slice(start, start + micro), N // micro) for start in range(0, N, micro)
    )
    total.backward()
    entropy_grad = torch.zeros_like(entropy) if entropy.grad is None else entropy.grad.clone()
    return total.detach(), logps.grad.clone(), entropy_grad


COMBINATIONS = [
    dict(zip(("loss_type", "importance_sampling_level", "epsilon_high", "delta", "kl", "entropy_coef"), c))
    for c in itertools.product(
        LOSS_TYPES,
        ("token", "sequence"),
        (None, 0.28, 0.0),
        (None, 1.5),
        ("off", "plain", "bias-corrected"),
        (0.0, 0.01),
    )  # fmt: skip
]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("later_iteration", [False, True], ids=["first iteration", "later iteration"])
def test_every_supported_combination_equals_trls_loss_and_gradient(scale_rewards, later_iteration):
    logps, old, ref, mask, entropy, rewards = inputs(seed=7, later_iteration=later_iteration)
    advantages = group_advantages(rewards, K, scale_rewards)
    checked = 0
    for combination in COMBINATIONS:
        options = dict(
            combination, epsilon_low=0.2, beta=0.0 if combination["kl"] == "off" else 0.04,
            use_bias_correction_kl=combination["kl"] == "bias-corrected",
        )  # fmt: skip
        # TRL's entropy bonus is each micro-batch's token mean: equal to ours on the whole batch only.
        for micro in (N,) if options["entropy_coef"] else (N, 6, 4):
            tensors = (logps, old, ref, mask, entropy, advantages)
            theirs = loss_and_grads(trl_loss, options, tensors, micro)
            ours = loss_and_grads(our_loss, options, tensors, micro)
            for name, a, b in zip(("loss", "logps grad", "entropy grad"), ours, theirs):
                assert torch.allclose(a, b, rtol=1e-12, atol=1e-15), (
                    f"{name} differs: {options}, micro {micro}"
                )
            checked += 1
    assert checked == len(COMBINATIONS) // 2 * 3 + len(COMBINATIONS) // 2

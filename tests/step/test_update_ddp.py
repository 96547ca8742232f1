"""The update under 2-process DDP on CPU (gloo): the ranks' averaged gradient is the gradient of their whole
batch, as one process computes it, whatever each rank's completion lengths (`exgrpo_pl.step.update`)."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.step.sampling import fresh_rollouts

pytestmark = pytest.mark.multiprocess

K, PROMPTS_PER_RANK, RANKS = 4, 2, 2
STEPS = [("dapo", "batch"), ("grpo", "batch"), ("dr_grpo", "none")]  # (loss_type, scale_rewards) per step


class FixedRollouts(ExGRPOModule):
    """Samples nothing: each step trains on one fixed batch of 16 rows, each rank on its half.

    Rank 0's completions are 1-2 tokens long with 0/1 rewards, rank 1's 3-4 tokens with rewards spread wider,
    so the ranks differ in token count and in reward scale. One process takes all 16 rows.
    """

    def _collect(self, plan, temperature):
        gen = torch.Generator().manual_seed(0)
        rows, width = RANKS * PROMPTS_PER_RANK * K, self.hparams.max_completion_length
        prompt_ids = torch.randint(3, len(self.tokenizer), (rows, 3), generator=gen)
        completion_ids = torch.randint(3, len(self.tokenizer), (rows, width), generator=gen)
        half = rows // 2
        lengths = torch.cat(
            [torch.randint(1, 3, (half,), generator=gen), torch.randint(3, 5, (half,), generator=gen)]
        )
        completion_mask = torch.arange(width) < lengths.unsqueeze(1)
        rewards = torch.cat(
            [torch.randint(0, 2, (half,), generator=gen) * 1.0, torch.rand(half, generator=gen) * 3]
        )
        mine = slice(self.global_rank * plan.num_rollouts, (self.global_rank + 1) * plan.num_rollouts)
        fresh = fresh_rollouts(
            plan, prompt_ids[mine], torch.ones_like(prompt_ids[mine]), completion_ids[mine],
            completion_mask[mine], rewards[mine],
        )  # fmt: skip
        return fresh.to(self.device), {"generated_tokens": 0}


class StepOptions(Callback):
    """Sets each step's loss options from STEPS, and records the gradient each step applies."""

    def __init__(self, out_path=None):
        self.out_path, self.grads = out_path, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.hparams.loss_type, pl_module.hparams.scale_rewards = STEPS[batch_idx]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(torch.cat([p.grad.flatten() for p in pl_module.policy.parameters()]).clone())

    def on_train_end(self, trainer, pl_module):
        if self.out_path is not None:
            torch.save(self.grads, self.out_path / f"rank{trainer.global_rank}.pt")


def fit(model_dir, devices, callback, root, steps_per_generation=1):
    module = FixedRollouts(
        model_dir, num_generations=K, max_completion_length=4, learning_rate=1e-3,
        reward_timeout_seconds=None, micro_batch_size=3, max_grad_norm=0.0, beta=0.1, entropy_coef=0.01,
        steps_per_generation=steps_per_generation,
    )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy="ddp_fork" if devices > 1 else "auto",
        max_steps=len(STEPS) * steps_per_generation, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[callback],
        default_root_dir=root,
    )  # fmt: skip
    data = PromptDataModule(
        synthetic=ArithmeticTask(64, seed=1), batch_size=PROMPTS_PER_RANK * RANKS // devices, val_fraction=0.0
    )
    trainer.fit(module, datamodule=data)


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_two_ranks_apply_the_gradient_of_their_whole_batch(tiny_model_dir, tmp_path, steps_per_generation):
    """With 2 updates a batch each rank deals its 2 groups out to them, as one process deals its 4: update 0
    trains groups 0 and 2 either way."""
    fit(tiny_model_dir, RANKS, StepOptions(tmp_path), tmp_path, steps_per_generation)
    one_rank = StepOptions()
    fit(tiny_model_dir, 1, one_rank, tmp_path, steps_per_generation)

    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(RANKS)]
    assert len(one_rank.grads) == len(ranks[0]) == len(STEPS) * steps_per_generation
    options_of_update = [options for options in STEPS for _ in range(steps_per_generation)]
    for step, (options, expected) in enumerate(zip(options_of_update, one_rank.grads)):
        scale = expected.abs().max()
        assert scale > 0
        for rank in ranks:
            error = float((rank[step] - expected).abs().max() / scale)
            assert error < 1e-4, f"step {step} {options}: the ranks' gradient is {error:.1%} off"

"""ReplayCallback(placement="refill") under 2-process DDP on CPU (gloo): every rank refills as many groups at
each step, the fewest any rank could (its groups of equal rewards, its pool), since the second generation
round is collective under ZeRO-3."""

import json

import pytest
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
from exgrpo_pl.step.refill import idle_groups

pytestmark = pytest.mark.multiprocess

ROWS, BATCH, K = 16, 4, 4  # 4 questions a step on each of 2 ranks: 2 steps an epoch


class SaveCounts(Callback):
    """Per step on this rank: (groups refilled, groups this rank alone could have refilled)."""

    def __init__(self, root):
        self.root, self.counts = root, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts, gave_way = outputs["rollouts"], outputs["gave_way"]
        refilled = int(rollouts.replayed.sum())
        fresh = rollouts.select(~rollouts.replayed.view(-1, K).any(1).repeat_interleave(K), group_size=K)
        idle = refilled + int(idle_groups(fresh.rewards, K).sum())  # the first round's idle groups
        experience = batch.get("experience")
        own = min(idle, len(experience.rollouts)) if experience is not None else 0
        assert (gave_way is None and refilled == 0) or len(gave_way) == K * refilled
        self.counts.append((refilled, own))

    def on_train_end(self, trainer, pl_module):
        (self.root / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.counts))


def test_every_rank_refills_as_many_groups_the_fewest_any_rank_could(tmp_path, tiny_model_dir):
    seed_everything(0)
    replay = ReplayCallback(
        mode="mix", placement="refill", mix_fraction=1.0, min_buffer_size=1,
        replay=SelectiveReplay("uniform", replay_probability=1.0,
                               replayed_trajectories="any_stored_including_incorrect"),
        buffer=TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4, retire_from="buffer")),
    )  # fmt: skip
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=6, logger=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, callbacks=[replay, SaveCounts(tmp_path)],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
    trainer.fit(tiny_module(tiny_model_dir, num_generations=K, max_completion_length=3), datamodule=data)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    refilled = [[n for n, _ in rank] for rank in ranks]
    own = [[m for _, m in rank] for rank in ranks]
    assert refilled[0] == refilled[1] == [min(a, b) for a, b in zip(*own)] and any(refilled[0])
    assert own[0] != own[1]  # the ranks alone would have refilled different numbers

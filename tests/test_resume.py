"""Resume equivalence: 2 epochs straight == 1 epoch, checkpoint, 1 more epoch (model, buffer, counters)."""

import torch
from conftest import tiny_module
from exgrpo_pl.callbacks import ReplayCallback
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.replay import SelectiveReplay


def train(tmp_path, model_dir, epochs, ckpt_path=None):
    seed_everything(0)
    module = tiny_module(model_dir)
    replay = ReplayCallback(mode="mix", min_buffer_size=1, replay=SelectiveReplay("uniform", 0.5))
    trainer = Trainer(
        max_epochs=epochs,
        limit_train_batches=3,
        limit_val_batches=0,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[replay, ModelCheckpoint(dirpath=tmp_path, save_last=True)],
    )
    trainer.fit(
        module, PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4), ckpt_path=ckpt_path
    )
    return module, replay


def test_resumed_training_matches_uninterrupted_training(tmp_path, tiny_model_dir):
    straight, straight_replay = train(tmp_path / "a", tiny_model_dir, epochs=2)
    train(tmp_path / "b", tiny_model_dir, epochs=1)
    resumed, resumed_replay = train(
        tmp_path / "b", tiny_model_dir, epochs=2, ckpt_path=tmp_path / "b" / "last.ckpt"
    )

    for a, b in zip(straight.policy.parameters(), resumed.policy.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert straight.generated_tokens == resumed.generated_tokens > 0
    assert straight_replay.replayed_steps == resumed_replay.replayed_steps > 0
    a, b = straight_replay.buffer.state_dict(), resumed_replay.buffer.state_dict()
    assert len(straight_replay.buffer) == len(resumed_replay.buffer)
    assert torch.equal(a["question_id"], b["question_id"])

"""ReplayCallback under 2-process DDP on CPU (gloo): same decisions on every rank, per-rank checkpoints."""

import json

import pytest
import torch
from conftest import tiny_module
from exgrpo_pl.callbacks import ReplayCallback
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.replay import SelectiveReplay

pytestmark = pytest.mark.multiprocess


class RecordDecisions(Callback):
    """Writes, per rank, whether each step replayed and how many rows its buffer holds."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(bool(outputs["rollouts"].replayed.any()))

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        record = {"steps": self.steps, "buffer": len(replay.buffer)}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_every_rank_takes_the_same_replay_decisions_and_checkpoints_keep_each_buffer(
    tmp_path, tiny_model_dir
):
    seed_everything(0)
    replay = ReplayCallback(
        mode="swap",
        min_buffer_size=1,
        start_pass_rate=0.0,
        replay=SelectiveReplay(strategy="uniform", replay_probability=0.5),
    )
    module = tiny_module(tiny_model_dir, num_generations=2, max_completion_length=3)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[replay, RecordDecisions(tmp_path)],
    )
    trainer.fit(module, datamodule=PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=2))

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert any(ranks[0]["steps"]) and not all(ranks[0]["steps"])  # the coin really varied

    (checkpoint,) = tmp_path.rglob("*.ckpt")
    state = next(
        v for k, v in torch.load(checkpoint, weights_only=True)["callbacks"].items() if "Replay" in k
    )
    assert len(state["ranks"]) == 2  # rank 0 wrote both ranks' buffers
    for rank, record in enumerate(ranks):
        restored = ReplayCallback()
        restored.load_state_dict({"ranks": [state["ranks"][rank]]})
        assert len(restored.buffer) == record["buffer"] > 0

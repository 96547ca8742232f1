"""The `replay/*` charts are over all ranks: totals of what each rank holds, means of shares (2-process DDP
on CPU, gloo)."""

import json
import os

import pytest
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.rewards import FormatReward


class FormatRewardOnRankZero(FormatReward):
    """The format reward on rank 0, a narrower one on rank 1: the ranks store and replay different rows."""

    def __call__(self, prompts, completions, **kwargs):
        rewards = super().__call__(prompts, completions, **kwargs)
        if os.environ.get("LOCAL_RANK") == "1":
            return [reward if i % 2 else 0.0 for i, reward in enumerate(rewards)]
        return rewards


class RecordOwnAndLogged(Callback):
    """Writes, per rank and step, the rank's own buffer size and replayed share, and what was logged."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("replay/")}
        own = {"buffer": len(replay.buffer), "rows": outputs["rollouts"].replayed.float().mean().item()}
        self.steps.append({"own": own, "logged": logged})

    def on_train_end(self, trainer, pl_module):
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.steps))


@pytest.mark.multiprocess
def test_replay_charts_are_totals_and_means_over_ranks(tmp_path, tiny_model_dir):
    seed_everything(0)
    replay = ReplayCallback(
        mode="mix",
        min_buffer_size=1,
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0),
    )
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=5, logger=CSVLogger(tmp_path),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[replay, RecordOwnAndLogged(tmp_path)], enable_checkpointing=False,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4, val_fraction=0.0)
    trainer.fit(
        tiny_module(
            tiny_model_dir,
            num_generations=2,
            max_completion_length=3,
            reward_funcs=[FormatRewardOnRankZero(r"[0-9].*")],
        ),
        datamodule=data,
    )

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert any(one["own"]["buffer"] for one in ranks[1])
    assert any(zero["own"] != one["own"] for zero, one in zip(*ranks))  # rank 0 alone would show less
    for zero, one in zip(*ranks):
        assert zero["logged"] == one["logged"]  # every rank logs the same numbers
        logged = zero["logged"]
        assert logged["replay/buffer_size"] == zero["own"]["buffer"] + one["own"]["buffer"]
        assert logged["replay/row_fraction"] == pytest.approx((zero["own"]["rows"] + one["own"]["rows"]) / 2)

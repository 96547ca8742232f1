"""writes_step_metrics: logging only on the steps it names changes nothing a logger sees."""

import csv
from pathlib import Path

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from test_batch import rollout_batch

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.module.logging_steps import step_metrics, writes_step_metrics


class LogsBothWays(LightningModule):
    """Logs the step number every step as "always", and as "gated" only when writes_step_metrics says so."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        self.value = float(self.global_step + 10 * self.current_epoch)
        self.log("always", self.value, on_step=True, on_epoch=False)
        return self.layer(batch[0]).sum()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if writes_step_metrics(self.trainer):  # as ExGRPOModule does: after every callback's hook
            self.log("gated", self.value, on_step=True, on_epoch=False)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class StopAt(Callback):
    """Stops the run in its on_train_batch_end once `step` steps are done, as a token budget does."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


@pytest.mark.parametrize(
    ("log_every_n_steps", "max_steps", "limit_train_batches", "stop_at"),
    [
        (3, 7, 1.0, None),
        (50, 4, 1.0, None),
        (2, 9, 3, None),
        (1, 4, 1.0, None),
        (5, 20, 1.0, 3),
        (4, 20, 1.0, 7),
    ],
)
def test_gated_logging_writes_the_same_rows(
    tmp_path, log_every_n_steps, max_steps, limit_train_batches, stop_at
):
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(5, 1)), batch_size=1)
    trainer = Trainer(
        max_steps=max_steps,
        log_every_n_steps=log_every_n_steps,
        limit_train_batches=limit_train_batches,
        logger=CSVLogger(tmp_path),
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[StopAt(stop_at)] if stop_at else [],
    )
    trainer.fit(LogsBothWays(), data)
    path = Path(trainer.logger.experiment.metrics_file_path)
    # With 4 steps of a 50-step interval Lightning writes no row at all.
    rows = list(csv.DictReader(path.read_text().splitlines())) if path.exists() else []
    assert [(r["step"], r["always"]) for r in rows] == [(r["step"], r["gated"]) for r in rows]
    assert trainer.logged_metrics["always"] == trainer.logged_metrics["gated"]


def test_pass_at_1_is_logged_only_where_it_is_not_the_reward():
    rows = dict(completion_ids=torch.tensor([[5, 2, 0], [5, 5, 5]]), correct=torch.tensor([True, False]))
    binary = step_metrics(rollout_batch(rewards=torch.tensor([1.0, 0.0]), **rows), [2], {}, {})
    assert binary["train/reward"] == 0.5 and "train/pass@1" not in binary  # a 0/1 verifier: the same series
    graded = step_metrics(rollout_batch(rewards=torch.tensor([0.9, 0.2]), **rows), [2], {}, {})
    assert graded["train/reward"] == pytest.approx(0.55) and graded["train/pass@1"] == 0.5
    assert graded["train/completions/clipped_ratio"] == 0.5  # the second row never stops


def test_rewards_are_those_of_the_fresh_rows_and_a_step_without_any_has_none():
    rows = dict(
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        correct=torch.tensor([True, False, True, True]),
        group_size=2,
    )
    mixed = step_metrics(
        rollout_batch(4, replayed=torch.tensor([False, False, True, False]), **rows), [2], {}, {}
    )
    # the fresh rows' mean; the spread of the one whole fresh group (the other holds a stored row)
    assert mixed["train/reward"] == pytest.approx(2 / 3) and mixed["train/reward_std"] == pytest.approx(
        2**0.5 / 2
    )
    assert mixed["train/frac_reward_zero_std"] == 0.0
    swap = step_metrics(
        rollout_batch(4, replayed=torch.ones(4, dtype=torch.bool), **{**rows, "group_size": 1}),
        [2],
        {"loss": 0.5},
        {},
    )
    assert not any("reward" in name or "pass@1" in name for name in swap) and swap["train/loss"] == 0.5


def test_a_swap_replay_step_logs_no_reward_not_the_stored_rows_nor_the_last_fresh_steps(
    tmp_path, tiny_model_dir
):
    """Swap on every step it may, at most 2 in a row: steps 1, 2, 4 and 5 replay stored (correct) rows."""
    replay = ReplayCallback(
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0), mode="swap", min_buffer_size=1,
        max_consecutive_replay_steps=2,
    )  # fmt: skip
    trainer = Trainer(
        max_steps=6, accelerator="cpu", logger=CSVLogger(tmp_path), log_every_n_steps=1, callbacks=[replay],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(tiny_module(tiny_model_dir), datamodule=data)
    rows = list(csv.DictReader(Path(trainer.logger.log_dir, "metrics.csv").read_text().splitlines()))
    by_step = {int(row["step"]): row for row in rows if row.get("train/loss")}
    rewards = [name for name in rows[0] if name.startswith("train/reward")]  # the mean, std and per function
    assert {"train/reward", "train/reward_std", "train/rewards/format/mean"} <= set(rewards)
    for step, row in by_step.items():
        swapped = float(row["replay/row_fraction"]) == 1.0
        assert swapped == (step in (1, 2, 4, 5)), step
        assert all((row[name] == "") == swapped for name in rewards), (step, {n: row[n] for n in rewards})
        # Replay-only charts on the replay steps alone, not repeated from the last one on the fresh steps.
        assert (row["train/is_weight"] != "") == (row["replay/staleness"] != "") == swapped, step
        assert float(row["train/replayed_share"]) in ((0.0, 1.0) if swapped else (0.0,)), step

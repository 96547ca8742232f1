"""writes_step_metrics: logging only on the steps it names changes nothing a logger sees."""

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from test_batch import rollout_batch

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

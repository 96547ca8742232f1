"""writes_step_metrics: logging only on the steps it names changes nothing a logger sees."""

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

from exgrpo_pl.logging_steps import writes_step_metrics


class LogsBothWays(LightningModule):
    """Logs the step number every step as "always", and as "gated" only when writes_step_metrics says so."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        value = float(self.global_step + 10 * self.current_epoch)
        self.log("always", value, on_step=True, on_epoch=False)
        if writes_step_metrics(self.trainer):
            self.log("gated", value, on_step=True, on_epoch=False)
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("log_every_n_steps", "max_steps", "limit_train_batches"),
    [(3, 7, 1.0), (50, 4, 1.0), (2, 9, 3), (1, 4, 1.0)],
)
def test_gated_logging_writes_the_same_rows(tmp_path, log_every_n_steps, max_steps, limit_train_batches):
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
    )
    trainer.fit(LogsBothWays(), data)
    path = Path(trainer.logger.experiment.metrics_file_path)
    # With 4 steps of a 50-step interval Lightning writes no row at all.
    rows = list(csv.DictReader(path.read_text().splitlines())) if path.exists() else []
    assert [(r["step"], r["always"]) for r in rows] == [(r["step"], r["gated"]) for r in rows]
    assert trainer.logged_metrics["always"] == trainer.logged_metrics["gated"]

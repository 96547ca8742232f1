"""ExGRPOModule's evaluation: validation and test pass@1, and the validation pass@1 measured before the first
update (`validate_at_start`), each sampled on a generator of its own so that it never changes what training
samples.
"""

from __future__ import annotations

import itertools
import math

import torch
from lightning.pytorch.utilities import CombinedLoader, rank_zero_info
from torch import Tensor
from torchmetrics import MeanMetric

from exgrpo_pl.groups import plan_rollouts
from exgrpo_pl.seeding import derive_seed


class PassRateEvaluation:
    """Validation and test steps of `ExGRPOModule`: pass@1 of completions sampled at `val_temperature`.

    Reads the module's `hparams`, `_collect`, `val_pass_at_1` and `test_pass_at_1`.
    """

    def _pass_rate(self, batch: dict, batch_idx: int) -> Tensor:
        """`[B * n]` 1.0 where a completion sampled at `val_temperature` is correct, n per prompt.

        Validation samples from a generator of its own (forked from, and restored into, the global one), so
        how often a run validates never changes what its training steps sample.
        """
        hp = self.hparams
        temperature = hp.temperature if hp.val_temperature is None else hp.val_temperature
        plan = plan_rollouts(batch, hp.val_num_generations)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed("validation", self.global_step, batch_idx))
            rollouts, _ = self._collect(plan, temperature)
        return rollouts.correct.float()

    def _evaluate(self, batch: dict, batch_idx: int, metric: MeanMetric, name: str) -> None:
        metric.update(self._pass_rate(batch, batch_idx))
        self.log(name, metric, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch["prompt"]))

    def _validate_at_start(self) -> None:
        """With `validate_at_start`, measures validation pass@1 before the first update and logs it at step 0.
        Call in `on_train_start`."""
        # A resumed run measured its start already, and logged it at step 0.
        if not self.hparams.validate_at_start or self.trainer.datamodule is None or self.global_step > 0:
            return
        # The later validations' own loaders (sharded across ranks, limit_val_batches applied): the same
        # samples, each rank measuring its share, and the mean taken over all ranks.
        val_loop = self.trainer.fit_loop.epoch_loop.val_loop
        val_loop.setup_data()
        loaders = self.trainer.val_dataloaders
        if not loaders:  # no validation batches (limit_val_batches=0, an empty validation set)
            return
        start = MeanMetric().to(self.device)
        for loader, limit in zip(CombinedLoader(loaders).flattened, val_loop.max_batches):
            batches = itertools.islice(loader, None if math.isinf(limit) else int(limit))
            for batch_idx, batch in enumerate(batches):
                start.update(self._pass_rate(batch, batch_idx))
        value = float(start.compute())
        if self.logger is not None:
            self.logger.log_metrics({"val/pass@1": value}, step=self.global_step)
        rank_zero_info(f"val/pass@1 before training: {value:.3f}")

    def on_validation_start(self) -> None:
        self.val_pass_at_1.set_dtype(torch.float32)

    def on_test_start(self) -> None:
        self.test_pass_at_1.set_dtype(torch.float32)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, self.val_pass_at_1, "val/pass@1")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._evaluate(batch, batch_idx, self.test_pass_at_1, "test/pass@1")

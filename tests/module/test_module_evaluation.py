"""ExGRPOModule's evaluation: the start-of-run validation on several ranks, and pass@1 counted in float32."""

import json

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from torchmetrics import MeanMetric

from exgrpo_pl.data import ArithmeticTask, EvalSet, PromptDataModule
from exgrpo_pl.module import ExGRPOModule


def test_a_bf16_metric_state_miscounts_which_is_why_pass_at_1_is_reset_to_float32():
    """What Lightning's bf16-true plugin does to a metric (`module.to(dtype)`), and the reset undoing it."""
    outcomes = [1.0] * 347 + [0.0] * 153
    converted = MeanMetric().to(torch.bfloat16)
    for outcome in outcomes:
        converted.update(torch.tensor([outcome]))
    assert float(converted.mean_value) == 256.0  # a bf16 sum stops counting at 256
    reset = MeanMetric().to(torch.bfloat16)
    reset.set_dtype(torch.float32)
    for outcome in outcomes:
        reset.update(torch.tensor([outcome]))
    assert (float(reset.mean_value), float(reset.weight)) == (347.0, 500.0)


class RecordPassRates(ExGRPOModule):
    """Records, per rank, the questions each evaluation scored and their correctness: at the run's start
    (`start`) and in Lightning's validation loop (`validation`)."""

    def __init__(self, out_dir: str, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self.seen = {"start": [], "validation": []}

    def _pass_rate(self, batch, batch_idx):
        correct = super()._pass_rate(batch, batch_idx)
        phase = "validation" if self.trainer.validating else "start"
        self.seen[phase] += list(zip(batch["question_id"].tolist(), correct.tolist()))
        self.metric_dtypes = [str(self.val_pass_at_1.mean_value.dtype)]
        return correct

    def on_train_end(self):
        with open(f"{self.out_dir}/rank{self.global_rank}.json", "w") as file:
            json.dump({**self.seen, "val_curve": self.val_curve}, file)


@pytest.mark.multiprocess
def test_the_start_validation_scores_each_rank_s_share_of_the_later_validations_samples(
    tmp_path, tiny_model_dir
):
    settings = tiny_module(tiny_model_dir).hparams
    module = RecordPassRates(str(tmp_path), **{**settings, "validate_at_start": True, "val_temperature": 0.0})
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        max_steps=1,
        val_check_interval=1,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = PromptDataModule(
        synthetic=ArithmeticTask(35, seed=1), val_fraction=0.2, batch_size=2, val_batch_size=2
    )
    trainer.fit(module, datamodule=data)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    data.setup("fit")  # in this process too (the ranks were forked children)
    questions = [row["id"] for row in data.val_rows]
    assert len(questions) % 2 == 1  # so that Lightning's sampler repeats one on the second rank
    for rank in ranks:
        assert len(rank["start"]) == (len(questions) + 1) // 2
        assert [q for q, _ in rank["start"]] == [q for q, _ in rank["validation"]]
    assert {q for rank in ranks for q, _ in rank["start"]} == set(questions)
    (metrics,) = list(tmp_path.rglob("metrics.csv"))
    first = next(line for line in metrics.read_text().splitlines()[1:] if line.split(",")[1] == "0")
    outcomes = [c for rank in ranks for _, c in rank["start"]]
    assert f"{sum(outcomes) / len(outcomes)}" in first  # the mean over both ranks' shares, logged at step 0
    # Every rank keeps the same curve (each validation's value synced over the ranks): the start, and the
    # validation after the first batch, which Lightning logs at step 0 too.
    assert ranks[0]["val_curve"] == ranks[1]["val_curve"]
    assert [step for step, _ in ranks[0]["val_curve"]] == [0, 0]


def test_pass_at_1_counts_in_float32_under_bf16_true(tiny_model_dir, tmp_path):
    module = RecordPassRates(str(tmp_path), **tiny_module(tiny_model_dir).hparams)
    trainer = Trainer(
        accelerator="cpu", precision="bf16-true", logger=False, enable_progress_bar=False, limit_val_batches=2
    )
    data = PromptDataModule(synthetic=ArithmeticTask(40, seed=1), val_fraction=0.5, batch_size=2)
    (result,) = trainer.validate(module, datamodule=data)
    assert next(module.policy.parameters()).dtype == torch.bfloat16  # the plugin converted the module
    assert module.metric_dtypes == ["torch.float32"]
    outcomes = [c for _, c in module.seen["validation"]]
    assert result["val/pass@1"] == pytest.approx(sum(outcomes) / len(outcomes), abs=1e-7)


def test_the_start_validation_measures_named_sets_when_they_are_the_only_ones(tmp_path, tiny_model_dir):
    """`val_fraction=0` and named sets alone (the paper's layout): the sets are measured at step 0, as
    `validate` measures them before training, and no NaN pass@1 is logged."""
    sets = {"ood": EvalSet(synthetic=ArithmeticTask(6, seed=5), num_samples=2)}

    def data():
        return PromptDataModule(
            synthetic=ArithmeticTask(40, seed=1), val_fraction=0.0, batch_size=2, eval_sets=sets
        )

    seed_everything(0)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    (before,) = trainer.validate(tiny_module(tiny_model_dir), datamodule=data(), verbose=False)
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu", max_steps=1, logger=CSVLogger(tmp_path), enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(tiny_module(tiny_model_dir, validate_at_start=True), datamodule=data())
    (metrics,) = list(tmp_path.rglob("metrics.csv"))
    header, *lines = metrics.read_text().splitlines()
    logged = [dict(zip(header.split(","), line.split(","))) for line in lines]
    start = next(row for row in logged if row["step"] == "0" and row.get("val/ood/avg@2"))
    assert float(start["val/ood/avg@2"]) == pytest.approx(before["val/ood/avg@2"])
    assert float(start["val/average/score"]) == pytest.approx(before["val/average/score"])
    assert "val/pass@1" not in header.split(",")

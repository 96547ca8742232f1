"""Tests for PromptDataModule and ExcludingRandomSampler: batches, retirement, DDP wrapping, state."""

import json

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

from exgrpo_pl.data import ArithmeticTask, ExcludingRandomSampler, PromptDataModule


def make_dm(**kwargs):
    dm = PromptDataModule(synthetic=ArithmeticTask(num_questions=40), batch_size=4, **kwargs)
    dm.setup("fit")
    return dm


def epoch_ids(loader):
    return [qid for batch in loader for qid in batch["question_id"].tolist()]


def test_batch_keys_and_shapes():
    dm = make_dm()
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"prompt", "answer", "question_id", "domain"}
    assert batch["question_id"].dtype == torch.long and batch["question_id"].shape == (4,)
    assert len(batch["prompt"]) == len(batch["answer"]) == len(batch["domain"]) == 4
    assert len(dm.train_rows) == 36 and len(dm.val_rows) == 4
    val_batches = list(dm.val_dataloader())
    assert sum(len(b["prompt"]) for b in val_batches) == 4


def test_file_data_keeps_extra_columns(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"q": f"{i}+1=", "a": i + 1, "src": f"s{i}"}) + "\n" for i in range(10))
    )
    dm = PromptDataModule(
        train_path=str(path), val_path=str(path), prompt_column="q", answer_column="a", batch_size=5
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"prompt", "answer", "question_id", "src"}
    assert len(dm.val_rows) == 10 and len(dm.train_rows) == 10


def test_no_validation_when_fraction_is_zero():
    assert make_dm(val_fraction=0.0).val_dataloader() == []


def test_shuffle_is_seeded_per_epoch():
    first, second = make_dm(seed=5), make_dm(seed=5)
    loader_a, loader_b = first.train_dataloader(), second.train_dataloader()
    epochs_a = [epoch_ids(loader_a) for _ in range(2)]
    assert epochs_a == [epoch_ids(loader_b) for _ in range(2)]
    assert epochs_a[0] != epochs_a[1] and sorted(epochs_a[0]) == sorted(epochs_a[1])
    loader_b.sampler.set_epoch(1)
    assert epoch_ids(loader_b) == epochs_a[1]


def test_excluded_questions_skipped_from_next_epoch():
    dm = make_dm(drop_last=False)
    loader = dm.train_dataloader()
    retired = [row["id"] for row in dm.train_rows[:10]]
    seen = []
    for i, batch in enumerate(loader):
        seen += batch["question_id"].tolist()
        if i == 0:
            dm.exclude_questions(torch.tensor(retired))
    assert len(seen) == 36  # the running epoch is unaffected
    next_epoch = epoch_ids(loader)
    assert len(next_epoch) == 26 and not set(next_epoch) & set(retired)
    assert dm.excluded_question_ids == frozenset(retired)


def test_all_retired_is_a_clear_error():
    dm = make_dm()
    dm.exclude_questions(row["id"] for row in dm.train_rows)
    with pytest.raises(RuntimeError, match="all 36 training questions are retired"):
        next(iter(dm.train_dataloader()))


def test_state_dict_round_trip():
    dm = make_dm()
    dm.exclude_questions([3, 1, 2])
    state = dm.state_dict()
    assert state == {"excluded_question_ids": [1, 2, 3]}
    restored = make_dm()
    loader = restored.train_dataloader()  # built before the restore, as on resume
    restored.load_state_dict(state)
    assert restored.excluded_question_ids == {1, 2, 3}
    assert not {1, 2, 3} & set(epoch_ids(loader))


def test_under_the_ddp_wrapper_lengths_stay_fixed_and_retired_ids_vanish():
    ids = list(range(20))
    excluded = set()
    ranks = [
        DistributedSamplerWrapper(
            ExcludingRandomSampler(ids, excluded, seed=0), num_replicas=2, rank=r, shuffle=False
        )
        for r in range(2)
    ]
    first = [list(s) for s in ranks]
    assert sorted(first[0] + first[1]) == ids
    excluded.update(range(7))
    for sampler in ranks:
        sampler.set_epoch(1)
    second = [list(s) for s in ranks]
    assert [len(x) for x in second] == [10, 10]  # same steps on every rank: no collective hangs
    assert not set(second[0] + second[1]) & excluded
    assert set(second[0] + second[1]) == set(range(7, 20))  # padding repeats a few remaining ones


class _Retirer(L.LightningModule):
    """Records the question ids it trains on; retires the first batch of epoch 0."""

    def __init__(self, dm):
        super().__init__()
        self.dm, self.weight, self.seen = dm, torch.nn.Parameter(torch.zeros(1)), {}

    def training_step(self, batch, batch_idx):
        ids = batch["question_id"].tolist()
        self.seen.setdefault(self.current_epoch, []).extend(ids)
        if self.current_epoch == 0 and batch_idx == 0:
            self.dm.exclude_questions(ids)
        return (self.weight**2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(max_epochs, ckpt_path=None):
    dm = PromptDataModule(synthetic=ArithmeticTask(num_questions=20), batch_size=4, val_fraction=0.0)
    model = _Retirer(dm)
    trainer = L.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, dm, model


def test_trainer_epoch_after_retirement_skips_retired():
    _, _, model = fit(max_epochs=2)
    retired = set(model.seen[0][:4])
    assert len(model.seen[0]) == 20 and len(model.seen[1]) == 16
    assert not retired & set(model.seen[1])


def test_retired_questions_survive_a_checkpoint(tmp_path):
    trainer, dm, _ = fit(max_epochs=1)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert checkpoint["PromptDataModule"] == dm.state_dict() and len(dm.excluded_question_ids) == 4
    _, resumed, model = fit(max_epochs=2, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.excluded_question_ids == dm.excluded_question_ids
    assert len(model.seen[1]) == 16 and not set(model.seen[1]) & dm.excluded_question_ids


def test_invalid_arguments():
    with pytest.raises(ValueError, match="batch sizes"):
        PromptDataModule(batch_size=0)
    with pytest.raises(ValueError, match="val_fraction"):
        PromptDataModule(val_fraction=1.0)

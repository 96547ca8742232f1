"""Tests for PromptDataModule and ExcludingRandomSampler: batches, the paper's verl data layout, retirement,
sharding, seeds, the resumable training loader, and data too small for one batch."""

import io
import json
import zlib
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DistributedSampler

from exgrpo_pl.checkpoints import SafeModelCheckpoint
from exgrpo_pl.checkpoints.resume import resumable_fit_progress, settle_resumed_step_count
from exgrpo_pl.data import ArithmeticTask, ExcludingRandomSampler, PromptDataModule


def make_dm(**kwargs):
    dm = PromptDataModule(synthetic=ArithmeticTask(num_questions=40), batch_size=4, **kwargs)
    dm.setup("fit")
    return dm


def epoch_ids(loader):
    return [qid for batch in loader for qid in batch["question_id"].tolist()]


def ids(dm):
    return [row["id"] for row in dm.train_rows]


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


VERL = Path(__file__).parent / "samples" / "verl" / "verl_math.parquet"
VERL_SOURCES = ["aime24", "amc23", "math500", "gsm8k"]


def test_the_papers_verl_data_through_the_datamodule():
    dm = PromptDataModule(
        train_path=str(VERL), prompt_column="prompt", answer_column="reward_model.ground_truth",
        domain_column="data_source", drop_system_prompt=True, val_fraction=0.25, batch_size=4, seed=0,
    )  # fmt: skip
    dm.setup("fit")
    rows = dm.train_rows + dm.val_rows
    assert len(rows) == 12 and sorted(row["domain"] for row in dm.val_rows) == sorted(VERL_SOURCES)
    assert {row["domain"] for row in dm.train_rows} == set(VERL_SOURCES)  # the split is stratified by source
    by_answer = {row["answer"]: row for row in rows}
    math500 = by_answer["\\frac{3}{4}"]
    assert math500["prompt"] == [{"role": "user", "content": "What is $\\frac{1}{2} + \\frac{1}{4}$?"}]
    assert math500["domain"] == "math500" and math500["reward_model"]["style"] == "rule"
    assert math500["extra_info"] == {"index": 0, "split": "test"} and math500["ability"] == "math"
    assert dm.locate(math500) == f"{VERL}: row 7"  # found again under its system prompt
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {
        "prompt",
        "answer",
        "question_id",
        "domain",
        "ability",
        "reward_model",
        "extra_info",
    }
    assert all(prompt[0]["role"] == "user" for prompt in batch["prompt"])
    assert set(batch["domain"]) <= set(VERL_SOURCES)


def test_the_system_prompt_stays_unless_dropped():
    dm = PromptDataModule(
        train_path=str(VERL), val_path=str(VERL), answer_column="reward_model.ground_truth", batch_size=4
    )
    dm.setup("fit")
    assert [message["role"] for message in dm.train_rows[0]["prompt"]] == ["system", "user"]
    assert dm.hparams.drop_system_prompt is False
    assert dm.locate(dm.train_rows[0]) == f"{VERL}: row 1"


def test_no_validation_when_fraction_is_zero():
    assert make_dm(val_fraction=0.0).val_dataloader() == []


def test_shuffle_is_seeded_per_epoch():
    first, second = make_dm(seed=5), make_dm(seed=5)
    loader_a, loader_b = first.train_dataloader(), second.train_dataloader()
    epochs_a = [epoch_ids(loader_a) for _ in range(2)]
    assert epochs_a == [epoch_ids(loader_b) for _ in range(2)]
    assert epochs_a[0] != epochs_a[1] and sorted(epochs_a[0]) == sorted(epochs_a[1])
    third = make_dm(seed=5).train_dataloader()
    third.sampler.epoch = 1  # the pass counter, which a checkpoint restores
    assert epoch_ids(third) == epochs_a[1]
    third.sampler.set_epoch(0)  # Lightning's epoch number is ignored
    assert epoch_ids(third) != epochs_a[0]
    assert epoch_ids(make_dm(seed=6).train_dataloader()) != epochs_a[0]


def test_the_order_follows_the_run_seed_unless_seed_is_given(monkeypatch):
    def first_epoch(run_seed, **kwargs):
        monkeypatch.setenv("PL_GLOBAL_SEED", str(run_seed))
        return epoch_ids(make_dm(**kwargs).train_dataloader())

    assert first_epoch(1) == first_epoch(1) != first_epoch(2)
    assert first_epoch(1, seed=7) == first_epoch(2, seed=7)
    # Read when the loader is built: a seed_everything after construction counts.
    monkeypatch.setenv("PL_GLOBAL_SEED", "1")
    dm = make_dm()
    monkeypatch.setenv("PL_GLOBAL_SEED", "2")
    assert epoch_ids(dm.train_dataloader()) == first_epoch(2)


def test_the_held_out_split_does_not_follow_the_run_seed(tmp_path, monkeypatch):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(50)))

    def val_ids(run_seed, seed=None):
        monkeypatch.setenv("PL_GLOBAL_SEED", str(run_seed))
        dm = PromptDataModule(train_path=str(path), val_fraction=0.2, batch_size=4, seed=seed)
        dm.setup("fit")
        return sorted(row["id"] for row in dm.val_rows)

    assert val_ids(1) == val_ids(2) == val_ids(3, seed=0) != val_ids(1, seed=5)


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
    # As long as every epoch: 10 of the 26 remaining questions fill the retired ones' slots.
    assert len(next_epoch) == 36 and not set(next_epoch) & set(retired)
    assert set(next_epoch) == set(ids(dm)) - set(retired) and len(set(next_epoch)) == 26
    assert dm.excluded_question_ids == frozenset(retired)


def test_questions_no_longer_excluded_return_from_the_next_pass():
    dm = make_dm(drop_last=False)
    loader = dm.train_dataloader()
    retired = [row["id"] for row in dm.train_rows[:10]]
    dm.exclude_questions(retired)
    assert not set(epoch_ids(loader)) & set(retired)
    dm.exclude_questions(retired[5:])  # the set now: the first five are re-admitted
    following = set(epoch_ids(loader))
    assert set(retired[:5]) <= following and not following & set(retired[5:])


def test_fewer_left_than_a_batch_is_a_clear_error():
    dm = make_dm()
    loader = dm.train_dataloader()
    epoch_ids(loader)
    dm.exclude_questions(row["id"] for row in dm.train_rows[:33])  # retired during training
    with pytest.raises(RuntimeError, match="only 3 of 36 training questions are left .* batch of 4"):
        iter(loader)


def test_all_retired_is_a_clear_error():
    dm = make_dm()
    dm.exclude_questions(row["id"] for row in dm.train_rows)
    with pytest.raises(RuntimeError, match="all 36 training questions are retired"):
        next(iter(dm.train_dataloader()))


def test_pass_hooks_run_right_before_each_pass_once_each():
    dm = make_dm()
    calls = []

    def hook(datamodule):
        calls.append(datamodule.excluded_question_ids)
        datamodule.exclude_questions([ids(dm)[len(calls)]])

    dm.add_pass_hook(hook)
    dm.add_pass_hook(hook)
    loader = dm.train_dataloader()
    first, second = epoch_ids(loader), epoch_ids(loader)
    assert calls == [frozenset(), {ids(dm)[1]}]
    assert ids(dm)[1] not in first and ids(dm)[2] not in second and ids(dm)[2] in first


def test_state_dict_round_trip():
    dm = make_dm()
    dm.exclude_questions([3, 1, 2])
    assert dm.state_dict() == {"excluded_question_ids": [1, 2, 3], "start_rows": None}
    dm.train_dataloader()
    state = dm.state_dict()
    assert state == {"excluded_question_ids": [1, 2, 3], "start_rows": 36 - len({1, 2, 3} & set(ids(dm)))}
    restored = make_dm()
    loader = restored.train_dataloader()  # built before the restore, as on resume
    restored.load_state_dict(state)
    assert restored.excluded_question_ids == {1, 2, 3}
    assert not {1, 2, 3} & set(epoch_ids(loader))


def test_a_loader_state_saved_over_other_training_questions_is_refused_naming_the_change():
    state = make_dm().train_dataloader().state_dict()
    assert state["questions"] == {
        "rows": 36,
        "crc32": zlib.crc32(",".join(map(str, ids(make_dm()))).encode()),
    }
    said = (
        r"ArithmeticTask.* are not those the checkpoint was trained on \(36 then, 19 now\), so its data order"
    )
    with pytest.raises(ValueError, match=said):
        make_dm(val_fraction=0.55).train_dataloader().load_state_dict(state)
    other = PromptDataModule(synthetic=ArithmeticTask(num_questions=40, seed=1), batch_size=4)
    other.setup("fit")
    with pytest.raises(ValueError, match=r"\(36 both times, but other questions or another order\)"):
        other.train_dataloader().load_state_dict(state)
    make_dm().train_dataloader().load_state_dict(state)  # the same questions resume
    del state["questions"]
    make_dm().train_dataloader().load_state_dict(state)  # a state saved before the record was kept


def test_resuming_on_another_training_file_stops_before_training(tmp_path):
    def fit_file(rows, ckpt_path=None):
        path = tmp_path / f"train{rows}.jsonl"
        path.write_text(
            "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(rows))
        )
        dm = PromptDataModule(train_path=str(path), batch_size=4, val_fraction=0.0)
        model = _Retirer(dm)
        trainer = L.Trainer(
            max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
        return trainer, model

    trainer, _ = fit_file(36)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    with pytest.raises(
        ValueError, match=r"train12\.jsonl' are not those the checkpoint was trained on \(36 then"
    ):
        fit_file(12, ckpt_path=tmp_path / "step2.ckpt")


def test_sharded_lengths_stay_fixed_and_retired_ids_vanish():
    question_ids = list(range(20))
    excluded = set()
    ranks = [ExcludingRandomSampler(question_ids, excluded, 0, num_replicas=2, rank=r) for r in range(2)]
    assert all(isinstance(s, DistributedSampler) for s in ranks)  # so Lightning does not wrap it
    for sampler in ranks:
        sampler.begin_pass()
    first = [list(s) for s in ranks]
    assert sorted(first[0] + first[1]) == question_ids
    excluded.update(range(7))
    for sampler in ranks:
        sampler.begin_pass()
    second = [list(s) for s in ranks]
    assert [len(x) for x in second] == [len(s) for s in ranks] == [10, 10]  # same steps on every rank
    assert not set(second[0] + second[1]) & excluded
    assert set(second[0] + second[1]) == set(range(7, 20))  # padding repeats a few remaining ones
    excluded.update(range(19))  # one question left: every slot of every rank repeats it
    for sampler in ranks:
        sampler.begin_pass()
    assert [list(s) for s in ranks] == [[19] * 10] * 2


def test_an_odd_row_count_pads_the_last_rank():
    ranks = [ExcludingRandomSampler(range(5), set(), 3, num_replicas=2, rank=r) for r in range(2)]
    for sampler in ranks:
        sampler.begin_pass()
    shards = [list(s) for s in ranks]
    assert [len(x) for x in shards] == [3, 3] and set(shards[0] + shards[1]) == set(range(5))
    with pytest.raises(ValueError, match="rank 2"):
        ExcludingRandomSampler(range(5), set(), 0, num_replicas=2, rank=2)


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
    assert len(model.seen[0]) == len(model.seen[1]) == 20
    assert not retired & set(model.seen[1])


def test_retired_questions_survive_a_checkpoint(tmp_path):
    trainer, dm, _ = fit(max_epochs=1)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert checkpoint["PromptDataModule"] == dm.state_dict() and len(dm.excluded_question_ids) == 4
    _, resumed, model = fit(max_epochs=2, ckpt_path=tmp_path / "last.ckpt")
    assert resumed.excluded_question_ids == dm.excluded_question_ids
    assert len(model.seen[1]) == 20 and not set(model.seen[1]) & dm.excluded_question_ids


def test_invalid_arguments():
    with pytest.raises(ValueError, match="PromptDataModule batch_size=0: must be >= 1"):
        PromptDataModule(batch_size=0)
    with pytest.raises(ValueError, match="val_fraction"):
        PromptDataModule(val_fraction=1.0)


# Data too small for one batch


def test_fewer_rows_than_one_batch_is_an_error_naming_rows_batch_and_file(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(5)))
    dm = PromptDataModule(train_path=str(path), val_path=str(path), batch_size=8)
    dm.setup("fit")
    with pytest.raises(ValueError, match=r"train_path '.*tiny.jsonl' has 5 training rows, .*batch_size=8"):
        dm.train_dataloader()
    kept_last = PromptDataModule(train_path=str(path), val_path=str(path), batch_size=8, drop_last=False)
    kept_last.setup("fit")
    assert [len(b["prompt"]) for b in kept_last.train_dataloader()] == [5]


def test_a_small_synthetic_task_names_the_task_and_the_held_out_rows():
    dm = PromptDataModule(synthetic=ArithmeticTask(num_questions=20), batch_size=32, val_fraction=0.25)
    dm.setup("fit")
    rows, held_out = len(dm.train_rows), len(dm.val_rows)
    assert held_out > 0
    with pytest.raises(ValueError, match=rf"ArithmeticTask\(num_questions=20.* has {rows} training rows after"
                       rf" {held_out} held out for validation"):  # fmt: skip
        dm.train_dataloader()


def test_the_trainer_stops_before_training_with_that_error(tmp_path):
    model = _Retirer(None)
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    dm = PromptDataModule(synthetic=ArithmeticTask(num_questions=6), batch_size=8, val_fraction=0.0)
    with pytest.raises(ValueError, match="has 6 training rows, fewer than one training batch of batch_size"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0 and model.seen == {}


def test_a_column_named_completions_stops_the_trainer_before_training(tmp_path):
    rows = [{"prompt": f"{i}+3=", "answer": str(i + 3), "completions": str(i + 3)} for i in range(8)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model = _Retirer(None)
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    dm = PromptDataModule(train_path=str(path), batch_size=2, val_fraction=0.0)
    with pytest.raises(
        ValueError, match=r"train\.jsonl: line 1: column 'completions' has the name of an arg"
    ):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0 and model.seen == {}


# The resumable training loader


def batches(loader, count):
    iterator = iter(loader)
    return [next(iterator)["question_id"].tolist() for _ in range(count)]


def weights_only(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_loader_restored_mid_pass_goes_on_where_it_stopped():
    dm = make_dm(seed=3)
    loader = dm.train_dataloader()
    first = epoch_ids(loader)
    iterator = iter(loader)
    taken = [next(iterator)["question_id"].tolist() for _ in range(3)]
    dm.exclude_questions(taken[0])  # later exclusions leave the running pass alone
    state, dm_state = weights_only(loader.state_dict()), dm.state_dict()
    rest = [b["question_id"].tolist() for b in iterator]
    following = epoch_ids(loader)

    resumed = make_dm(seed=99)  # the checkpoint's seed wins: the resumed run keeps the saved order
    resumed.load_state_dict(dm_state)
    restored = resumed.train_dataloader()
    restored.load_state_dict(state)
    assert [b["question_id"].tolist() for b in restored] == rest
    assert epoch_ids(restored) == following and following != first
    assert not set(following) & set(taken[0])


def test_a_loader_with_worker_processes_resumes_too():
    loader = make_dm(seed=3, num_workers=2).train_dataloader()
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    rest, following = [b["question_id"].tolist() for b in iterator], epoch_ids(loader)
    restored = make_dm(seed=3, num_workers=2).train_dataloader()
    restored.load_state_dict(state)
    assert [b["question_id"].tolist() for b in restored] == rest and epoch_ids(restored) == following


def test_a_pass_saved_at_its_end_resumes_with_the_next_pass():
    dm = make_dm(seed=3)
    loader = dm.train_dataloader()
    epoch_ids(loader)
    state = loader.state_dict()
    assert state["loader"] is None and state["pass"]["order"] is None  # no position, no order to keep
    following = epoch_ids(loader)
    restored = make_dm(seed=3).train_dataloader()
    restored.load_state_dict(state)
    assert epoch_ids(restored) == following


def test_an_epoch_cut_short_by_a_batch_limit_ends_the_pass():
    dm = make_dm(seed=3)
    loader = dm.train_dataloader()
    loader.epoch_batches = lambda: 2  # as Trainer(limit_train_batches=2) counts an epoch
    assert len(batches(loader, 2)) == 2
    state = loader.state_dict()
    assert state["loader"] is None
    following = batches(loader, 2)
    restored = make_dm(seed=3).train_dataloader()
    restored.load_state_dict(state)
    assert batches(restored, 2) == following


def test_iterating_again_before_taking_a_batch_keeps_the_pass_and_position():
    dm = make_dm(seed=3)
    loader = dm.train_dataloader()
    iter(loader)
    assert batches(loader, 2) == batches(make_dm(seed=3).train_dataloader(), 2)
    state = loader.state_dict()
    restored = make_dm(seed=3).train_dataloader()
    restored.load_state_dict(state)
    iter(restored)  # Lightning starts the iteration a second time on some resumes
    rest = [b["question_id"].tolist() for b in loader._iterator]
    assert [b["question_id"].tolist() for b in restored] == rest


class BatchRecorder(L.LightningModule):
    """Records (step, epoch, question ids) of each batch, and resumes as ExGRPOModule does: a stop at an
    epoch's end resumes there."""

    def __init__(self):
        super().__init__()
        self.weight, self.seen = torch.nn.Parameter(torch.zeros(1)), []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.global_step, self.current_epoch, batch["question_id"].tolist()))
        return (self.weight**2).sum()

    def on_load_checkpoint(self, checkpoint):
        self.resumed_at = resumable_fit_progress(checkpoint)

    def on_train_start(self):
        if getattr(self, "resumed_at", None) == "epoch end":
            settle_resumed_step_count(self.trainer)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Recorder(BatchRecorder):
    """Also records the step at each epoch start and at each validation."""

    def on_train_epoch_start(self):
        self.seen.append(("epoch start", self.global_step, self.current_epoch))

    def validation_step(self, batch, batch_idx):
        self.seen.append(("validation", self.global_step, self.current_epoch))


class _Retirement(L.Callback):
    """Retires the first question of every third step's batch, from the next pass on, through the
    datamodule's pass hook (as ReplayCallback does)."""

    def __init__(self):
        self.retired = set()

    def setup(self, trainer, pl_module, stage):
        trainer.datamodule.add_pass_hook(lambda dm: dm.exclude_questions(self.retired))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % 3 == 1:  # the step that just ran was 0, 3, 6, ...
            self.retired.add(batch["question_id"][0].item())

    def state_dict(self):
        return {"retired": sorted(self.retired)}

    def load_state_dict(self, state_dict):
        self.retired = set(state_dict["retired"])


def fit_recorded(root, max_steps, checkpoint=None, ckpt_path=None, val_fraction=0.0, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    dm = PromptDataModule(synthetic=ArithmeticTask(27, seed=1), batch_size=4, val_fraction=val_fraction)
    model = _Recorder()
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, limit_val_batches=1 if val_fraction else 0,
        callbacks=[_Retirement(), *([checkpoint] if checkpoint else [])],
        enable_checkpointing=checkpoint is not None, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    loop = trainer.fit_loop
    progress = [loop.epoch_progress.state_dict(), loop.epoch_loop.batch_progress.total.state_dict()]
    return model.seen, (progress, loop.epoch_loop._batches_that_stepped)


def step_of(entry) -> int:
    return entry[1] if isinstance(entry[0], str) else entry[0]


SAVERS = {  # where each saves the step's checkpoint
    "every step (on_train_batch_end)": (ModelCheckpoint, {"every_n_train_steps": 1}),
    "epoch end (on_train_epoch_end)": (SafeModelCheckpoint, {}),
    "train end only (on_train_end)": (SafeModelCheckpoint, {"every_n_epochs": 0}),
}


@pytest.mark.parametrize("saver", SAVERS)
@pytest.mark.parametrize("stop", [3, 6, 14, 18], ids=lambda s: f"stop{s}")
def test_a_resumed_trainer_sees_the_batches_and_epochs_of_the_uninterrupted_one(tmp_path, saver, stop):
    """6 batches an epoch, retired questions leaving from epoch 1 on: stops mid-epoch (3, 14) and after an
    epoch's last batch (6, 18), with each kind of checkpoint."""
    straight, progress = fit_recorded(tmp_path / "straight", 19)
    steps = [step for step in straight if not isinstance(step[0], str)]
    assert [epoch for _, epoch, _ in steps] == [0] * 6 + [1] * 6 + [2] * 6 + [3]
    cls, kwargs = SAVERS[saver]
    checkpoint = cls(tmp_path / "run", "{step}", save_top_k=-1, **kwargs)
    fit_recorded(tmp_path / "run", stop + (cls is ModelCheckpoint), checkpoint)
    resumed = fit_recorded(tmp_path / "run", 19, ckpt_path=tmp_path / "run" / f"step={stop}.ckpt")
    # The same batches in the same epochs, the same epoch starts, and the same loop progress at the end.
    after_stop = [entry for entry in straight if step_of(entry) >= stop]
    assert resumed == (after_stop, progress)


VALIDATION = {
    "no validation": (0.0, {}),
    "validation each epoch": (0.12, {}),
    "validation every 4 steps": (0.12, {"val_check_interval": 4, "check_val_every_n_epoch": None}),
}


@pytest.mark.parametrize("validation", VALIDATION)
def test_a_run_resumed_twice_is_the_uninterrupted_one(tmp_path, validation):
    """Stopped at an epoch's end (6), mid-epoch (14), and resumed each time: the same batches, epoch starts,
    validations and loop progress (logging steps included) as without a stop."""
    val_fraction, kwargs = VALIDATION[validation]
    straight, progress = fit_recorded(tmp_path / "straight", 18, val_fraction=val_fraction, **kwargs)
    root, seen = tmp_path / "run", []
    for stop, ckpt_path in [(6, None), (14, root / "step=6.ckpt"), (18, root / "step=14.ckpt")]:
        checkpoint = SafeModelCheckpoint(root, "{step}", save_top_k=-1)
        part, last_progress = fit_recorded(root, stop, checkpoint, ckpt_path, val_fraction, **kwargs)
        seen += part
    assert seen == straight and last_progress == progress
    assert any(entry[0] == "validation" for entry in seen) == bool(val_fraction)

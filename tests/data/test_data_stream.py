"""The training stream of deferred questions (`PassStream`, `PromptDataModule.stream_passes` and
`defer_questions`): every question of a pass trained exactly once, in order, the deferred ones first; a
pass as many questions longer as were deferred; passes that go on across epochs; the pass hooks once per
pass on every rank alike; retirement; the stream's state through a checkpoint, and a Trainer resumed
mid-pass that trains on the uninterrupted run's batches."""

import io

import lightning as L
import pytest
import torch
from test_data_datamodule import BatchRecorder

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.data.stream import PassStream

QUESTIONS = list(range(100, 112))  # question ids; dataset index i holds question 100 + i


def take(stream, n):
    iterator = iter(stream)  # a fresh iterator each time: the position is the stream's
    return [next(iterator) for _ in range(n)]


def run(stream, batches, deferred, batch_size=4):
    """Takes `batches` batches, deferring the last `deferred(step)` questions of each; returns the batches
    and the questions trained on (each batch without its deferred tail), as dataset indices."""
    taken, trained = [], []
    for step in range(batches):
        batch = take(stream, batch_size)
        r = deferred(step)
        stream.rewind([QUESTIONS[i] for i in batch[batch_size - r :]])
        taken.append(batch)
        trained += batch[: batch_size - r]
    return taken, trained


def pass_order(epoch, seed=0, excluded=()):
    """Pass `epoch` as the plain sampler draws it (its order, padded to the 12 questions of the start)."""
    plain = PassStream(QUESTIONS, set(excluded), seed, start_rows=len(QUESTIONS))
    plain.epoch = epoch
    plain.begin_pass()
    return plain._share_of(plain.order)


@pytest.mark.parametrize("pattern", ["none", "one each step", "three every other step", "varying"])
def test_every_question_of_a_pass_is_trained_once_in_order_with_the_deferred_first(pattern):
    deferred = {
        "none": lambda step: 0,
        "one each step": lambda step: 1,
        "three every other step": lambda step: 3 * (step % 2),
        "varying": lambda step: [2, 0, 4, 1, 3][step % 5],
    }[pattern]
    stream = PassStream(QUESTIONS, set(), seed=0)
    taken, trained = run(stream, 30, deferred)
    # What was trained on is the passes, one after another, each question of each once and in its order.
    passes = [pass_order(e) for e in range(len(trained) // len(QUESTIONS) + 1)]
    assert trained == sum(passes, [])[: len(trained)]
    # A batch starts with the questions the step before deferred, in their order.
    for step in range(1, len(taken)):
        r = deferred(step - 1)
        assert taken[step][:r] == taken[step - 1][4 - r :]
    if pattern == "one each step":  # 90 trained, 1 waiting: the 91st question is in the 8th pass
        assert (stream.order_epoch, stream.waiting) == (7, 1)


def test_a_pass_grows_by_the_questions_deferred_and_its_hooks_run_once_before_it():
    calls = []
    stream = PassStream(QUESTIONS, set(), seed=0, batch_size=4, before_pass=lambda: calls.append(1))
    run(stream, 3, lambda step: 0)  # 12 questions: exactly one pass
    assert (len(calls), stream.order_epoch, stream.position) == (1, 0, 12)
    # 3 trained a step: the second pass takes 4 steps, the 4th batch ending with (and deferring) the third
    # pass's first question, which that batch drew
    _, trained = run(stream, 4, lambda step: 1)
    assert trained == pass_order(1)
    assert (len(calls), stream.order_epoch, stream.position, stream.waiting) == (3, 2, 0, 1)
    run(stream, 1, lambda step: 0)
    assert (len(calls), stream.order_epoch, stream.position, stream.waiting) == (3, 2, 4, 0)


def test_a_batch_across_a_pass_boundary_can_defer_into_the_previous_pass():
    calls = []
    stream = PassStream(QUESTIONS, set(), seed=0, batch_size=4, before_pass=lambda: calls.append(1))
    run(stream, 2, lambda step: 0)
    take(stream, 2)  # 10 of the pass: the next batch holds its last 2 and the next pass's first 2
    batch = take(stream, 4)
    assert batch == pass_order(0)[10:] + pass_order(1)[:2] and len(calls) == 2
    stream.rewind([QUESTIONS[i] for i in batch[1:]])
    assert stream.position == -1 and stream.waiting == 3
    state = weights_only(stream.pass_state())
    assert state["previous"].tolist() == pass_order(0)
    restored = PassStream(QUESTIONS, set(), seed=5)
    restored.restore_pass(state)
    assert take(restored, 6) == take(stream, 6) == batch[1:] + pass_order(1)[2:5]
    assert len(calls) == 2  # the next pass was not drawn again


def test_only_the_last_questions_handed_out_can_be_deferred():
    stream = PassStream(QUESTIONS, set(), seed=0)
    with pytest.raises(ValueError, match="only 0 were handed out"):
        stream.rewind([QUESTIONS[0]])
    batch = take(stream, 4)
    with pytest.raises(ValueError, match="only the questions a training batch ends with"):
        stream.rewind([QUESTIONS[i] for i in batch[:2]])
    stream.rewind([QUESTIONS[i] for i in batch])  # the whole batch (a swap step)
    assert take(stream, 4) == batch


def test_ranks_that_defer_alike_reach_each_pass_boundary_at_the_same_batch():
    calls = {0: [], 1: []}
    ranks = [
        PassStream(QUESTIONS, set(), 0, 2, r, batch_size=2, before_pass=lambda r=r: calls[r].append(1))
        for r in range(2)
    ]
    trained = {0: [], 1: []}
    for step in range(12):
        for rank, stream in enumerate(ranks):
            batch = take(stream, 2)
            r = step % 2
            stream.rewind([QUESTIONS[i] for i in batch[2 - r :]])
            trained[rank] += batch[: 2 - r]
            assert len(calls[rank]) == len(calls[0])  # the same pass on every rank after each batch
    states = [{k: v.tolist() if torch.is_tensor(v) else v for k, v in s.pass_state().items()} for s in ranks]
    assert states[0] == states[1]  # so the checkpoint's copy, rank 0's, restores both
    assert sorted(trained[0][:6] + trained[1][:6]) == list(range(12))  # the first pass, each question once


def test_retired_questions_leave_the_passes_drawn_after_them():
    excluded = set()
    stream = PassStream(QUESTIONS, excluded, seed=0, batch_size=4, before_pass=lambda: excluded.add(101))
    _, trained = run(stream, 8, lambda step: 1)  # 24 questions trained: the first pass and 12 of the next
    assert trained == pass_order(0, excluded={101})[:12] + pass_order(1, excluded={101})[:12]
    assert 1 not in trained  # retired before the first pass: padding repeats another instead


def weights_only(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def make_dm(**kwargs):
    dm = PromptDataModule(
        synthetic=ArithmeticTask(num_questions=14), batch_size=4, val_fraction=0.0, **kwargs
    )
    dm.setup("fit")
    return dm


def test_the_datamodule_defers_only_on_a_stream():
    dm = make_dm()
    next(iter(dm.train_dataloader()))
    with pytest.raises(RuntimeError, match="stream_passes"):
        dm.defer_questions([1])
    assert dm.deferred_waiting == 0


def test_loaders_of_one_datamodule_share_the_stream_and_resume_it_exactly():
    dm = make_dm(seed=3)
    dm.stream_passes()
    counted = dm.train_dataloader()  # as Lightning's step count does, then dropped
    loader = dm.train_dataloader()
    assert loader.sampler is counted.sampler and len(loader) == 3
    iterator = iter(loader)
    first = next(iterator)
    dm.defer_questions(first["question_id"][-2:])
    assert dm.deferred_waiting == 2
    state = weights_only(loader.state_dict())
    assert state["loader"] is None and state["pass"]["position"] == 2
    rest = [b["question_id"].tolist() for b in iterator]  # an iterator yields an epoch: 3 batches
    rest.append(next(iter(loader))["question_id"].tolist())  # the next epoch's goes on with the stream
    assert len(rest) == 3 and rest[0][:2] == first["question_id"][-2:].tolist()

    resumed = make_dm(seed=99)  # the checkpoint's seed wins
    resumed.stream_passes()
    restored = resumed.train_dataloader()
    restored.load_state_dict(state)
    assert [b["question_id"].tolist() for b in restored] == rest  # an epoch from the restored position


def test_a_stream_takes_its_batches_in_this_process(recwarn):
    dm = make_dm(num_workers=2)
    with pytest.warns(UserWarning, match="num_workers=2"):
        dm.stream_passes()
    assert dm.train_dataloader().num_workers == 0


class _Defer(L.Callback):
    """Defers the last (step % 3) questions of each batch, and retires one question a pass."""

    def setup(self, trainer, pl_module, stage):
        trainer.datamodule.stream_passes()
        trainer.datamodule.add_pass_hook(lambda dm: dm.exclude_questions(dm.excluded_question_ids | {7}))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        r = trainer.global_step % 3
        trainer.datamodule.defer_questions(batch["question_id"][len(batch["prompt"]) - r :])


def fit(root, max_steps, ckpt_path=None):
    L.seed_everything(0, verbose=False)
    dm = PromptDataModule(synthetic=ArithmeticTask(13, seed=1), batch_size=4, val_fraction=0.0)
    model = BatchRecorder()
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, callbacks=[_Defer()],
        enable_checkpointing=ckpt_path is None,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen, dm


@pytest.mark.parametrize("stop", [3, 5], ids=["at the end of epoch 0", "mid epoch 1"])
def test_a_trainer_goes_on_with_the_pass_across_epochs_and_resumes_it_exactly(tmp_path, stop):
    """13 questions, batches of 4: 3 steps an epoch; a pass takes longer than an epoch."""
    straight, dm = fit(tmp_path / "straight", 12)
    assert [epoch for _, epoch, _ in straight] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    trained = [ids[: len(ids) - step % 3] for step, _, ids in straight]
    for step in range(1, 12):  # a batch starts with what the step before deferred
        r = (step - 1) % 3
        assert straight[step][2][:r] == straight[step - 1][2][4 - r :]
    first_pass = sum(trained, [])[:13]  # 7 retired before it: padding repeats another question
    assert set(first_pass) == {row["id"] for row in dm.train_rows} - {7}
    fit(tmp_path / "run", stop)
    (checkpoint,) = (tmp_path / "run").rglob("*.ckpt")
    resumed, _ = fit(tmp_path / "run", 12, ckpt_path=checkpoint)
    assert resumed == straight[stop:]

"""ReplayCallback(displaced_questions="defer") in real Trainer runs on a tiny model: the fresh questions a
replay step displaces come back first in the next batch, every question of a pass is trained on once, with
bounded demand and retirement, in swap mode, logged, and resumed bitwise; the option's checks."""

import pytest
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from test_resume import Run, assert_same, final_state, logged
from torch.utils.data import DataLoader

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.data import ArithmeticTask, PromptDataModule, collate_rows
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer

# These tests are about rank bookkeeping, not which rows are drawn: every stored row may be replayed.
ANY_STORED = {"replayed_trajectories": "any_stored_including_incorrect"}

ROWS, BATCH, K = 12, 4, 4  # 3 steps an epoch


class RecordSteps(Callback):
    """Per step: the batch's question ids, the fresh questions trained on (in group order), the replayed
    rows, and the stream's waiting count."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts = outputs["rollouts"]
        replayed = int(rollouts.replayed.sum())  # a mixed step: one stored row in each of the last groups
        groups = rollouts.question_ids.view(-1, K)[:, 0].tolist() if rollouts.group_size == K else []
        fresh = groups[: len(groups) - replayed]
        waiting = trainer.datamodule.deferred_waiting
        self.steps.append((batch["question_id"].tolist(), fresh, replayed, waiting))


def train(
    root, model_dir, steps, mode="mix", ckpt_path=None, retire_from="buffer", probability=0.9, **options
) -> Run:
    """The tiny module replaying from the second step with `probability` (uniform questions), deferring
    what it displaces; a checkpoint at the end."""
    seed_everything(0)
    module = tiny_module(model_dir)
    replay = ReplayCallback(
        mode=mode,
        min_buffer_size=1,
        displaced_questions="defer",
        replay=SelectiveReplay("uniform", replay_probability=probability, **ANY_STORED),
        buffer=TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4, retire_from=retire_from)),
        **options,
    )
    record = RecordSteps()
    checkpoint = SafeModelCheckpoint(dirpath=root / "checkpoints", save_last="link")
    trainer = Trainer(
        max_steps=steps, max_epochs=100, accelerator="cpu", logger=CSVLogger(root, name="log"),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=root, plugins=[AtomicCheckpointIO()], callbacks=[replay, checkpoint, record],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    run = Run(module, replay, trainer, data)
    run.steps = record.steps
    return run


def check_deferred(steps, batch_size=BATCH):
    """Each step trained its batch's first questions; the ones it displaced wait, and open the next batch."""
    for (batch, fresh, _, waiting), following in zip(steps, [*steps[1:], None]):
        displaced = batch_size - len(fresh)
        assert fresh == batch[: batch_size - displaced] and waiting == displaced
        if following is not None:
            assert following[0][:displaced] == batch[batch_size - displaced :]


def test_displaced_questions_come_back_first_and_every_question_is_trained_once_a_pass(
    tmp_path, tiny_model_dir
):
    run = train(tmp_path, tiny_model_dir, 9, mix_fraction=0.5)
    check_deferred(run.steps)
    displaced = [BATCH - len(fresh) for _, fresh, _, _ in run.steps]
    assert 0 in displaced and 2 in displaced  # some steps replayed (2 of 4 questions), some did not
    trained = sum((fresh for _, fresh, _, _ in run.steps), [])
    ids = sorted(row["id"] for row in run.data.train_rows)
    for start in range(0, len(trained) - ROWS + 1, ROWS):  # each pass: every question once
        assert sorted(trained[start : start + ROWS]) == ids
    # Fewer questions trained than 9 batches (3 epochs) hold: the third pass is not over.
    assert len(trained) == 9 * BATCH - sum(displaced) < 3 * ROWS
    assert run.replay.deferred_total == sum(displaced)
    assert logged(run, "replay/deferred_total")[8] == str(float(sum(displaced)))
    assert logged(run, "replay/deferred_questions")[8] == str(float(displaced[-1]))


def test_with_bounded_demand_and_retirement(tmp_path, tiny_model_dir):
    run = train(
        tmp_path, tiny_model_dir, 9, retire_from="buffer_and_stream", bounded_demand=True, mix_fraction=0.75
    )
    check_deferred(run.steps)
    assert run.replay.replayed_steps and run.data.excluded_question_ids and run.replay.deferred_total


def test_a_swap_step_defers_its_whole_batch(tmp_path, tiny_model_dir):
    run = train(tmp_path, tiny_model_dir, 6, mode="swap", probability=0.5)
    swapped = [step for step, (_, fresh, _, _) in enumerate(run.steps) if not fresh]
    assert swapped and swapped[-1] < 5
    for step in swapped:  # nothing fresh trained: the same batch comes back whole
        assert run.steps[step + 1][0] == run.steps[step][0]
    assert run.replay.deferred_total == BATCH * len(swapped)


RESUMED = {"retire_from": "buffer_and_stream", "bounded_demand": True, "mix_fraction": 0.75}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    """The uninterrupted run the resumed ones are compared with, trained once."""
    return train(tmp_path_factory.mktemp("straight"), tiny_model_dir, 6, **RESUMED)


@pytest.mark.parametrize(
    "stop", [pytest.param(3, marks=pytest.mark.slow), 4], ids=["at the end of epoch 0", "mid epoch 1"]
)
def test_a_resumed_run_is_the_uninterrupted_run_bitwise(tmp_path, tiny_model_dir, straight, stop, recwarn):
    options = RESUMED
    first = train(tmp_path / "split", tiny_model_dir, stop, **options)
    assert first.replay.deferred_total and first.data.deferred_waiting  # stopped with questions waiting
    resumed = train(tmp_path / "split", tiny_model_dir, 6, ckpt_path="last", **options)
    assert resumed.steps == straight.steps[stop:]
    assert_same(final_state(straight), final_state(resumed))
    assert resumed.replay.deferred_total == straight.replay.deferred_total
    assert logged(resumed) == {step: logged(straight)[step] for step in range(stop, 6)}
    assert not [w for w in recwarn if "Resuming" in str(w.message)]


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="displaced_questions='drop'; allowed: discard, defer"):
        ReplayCallback(mode="mix", displaced_questions="drop")
    assert ReplayCallback().displaced_questions == "discard"


def test_a_run_without_a_datamodule_that_takes_questions_back_stops_at_setup(tmp_path, tiny_model_dir):
    replay = ReplayCallback(mode="mix", min_buffer_size=1, displaced_questions="defer")
    trainer = Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[replay],
    )  # fmt: skip
    loader = DataLoader(ArithmeticTask(8).rows(), batch_size=4, collate_fn=collate_rows)
    with pytest.raises(TypeError, match="displaced_questions='defer' needs a datamodule with stream_passes"):
        trainer.fit(tiny_module(tiny_model_dir), train_dataloaders=loader)


def test_discard_keeps_the_plain_sampler(tmp_path, tiny_model_dir):
    replay = ReplayCallback(mode="mix", min_buffer_size=1)
    trainer = Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[replay], limit_val_batches=0,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
    trainer.fit(tiny_module(tiny_model_dir), data)
    assert not trainer.train_dataloader.sampler.is_stream
    assert "position" not in trainer.train_dataloader.state_dict()["pass"]  # the format as before

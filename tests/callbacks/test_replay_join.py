"""ReplayCallback(placement="join") in real Trainer runs on a tiny model: a question of the batch that the
buffer holds gets one of its stored trajectories as a member of its own group, every fresh question stays,
nothing joins on the first pass, the count is logged, a resumed run is the uninterrupted one bitwise; and the
placement options' checks."""

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from test_resume import Run, assert_same, final_state, logged

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.callbacks.placement import put_last
from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer

ROWS, BATCH, K = 12, 4, 4  # 3 steps an epoch
# These tests are about where the stored rows go, not which are drawn: every stored row may be replayed.
ANY_STORED = {"replayed_trajectories": "any_stored_including_incorrect"}


class RecordSteps(Callback):
    """Per step: the batch's question ids (as the step saw them), each group's question ids, the replayed
    rows' indices, and the rates of the questions the buffer held before the step."""

    def __init__(self):
        self.steps = []
        self._held = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        known = replay.buffer.bucketer.known_questions()
        self._held = dict(zip(known.tolist(), replay.buffer.bucketer.rates(known).tolist()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts = outputs["rollouts"]
        groups = rollouts.question_ids.view(-1, K).tolist()
        replayed = rollouts.replayed.nonzero().flatten().tolist()
        self.steps.append((batch["question_id"].tolist(), groups, replayed, self._held))


def fit_placement(
    root, model_dir, steps, placement, rows, record, ckpt_path=None, module=None, **options
) -> Run:
    """The tiny module (or `module`) placing experience by `placement` as soon as the buffer allows (uniform
    questions, every step, any stored row), on `rows` questions in batches of BATCH, recorded by `record` (its
    `steps` become the run's); a checkpoint at the end."""
    seed_everything(0)
    replay = ReplayCallback(
        mode="mix", placement=placement, min_buffer_size=1,
        replay=SelectiveReplay("uniform", replay_probability=1.0, **ANY_STORED),
        buffer=TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4, retire_from="buffer")), **options,
    )  # fmt: skip
    trainer = Trainer(
        max_steps=steps, max_epochs=100, accelerator="cpu", logger=CSVLogger(root, name="log"),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=root, plugins=[AtomicCheckpointIO()],
        callbacks=[replay, SafeModelCheckpoint(dirpath=root / "checkpoints", save_last="link"), record],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(rows, seed=1), batch_size=BATCH, val_fraction=0.0)
    trainer.fit(module or tiny_module(model_dir), data, ckpt_path=ckpt_path)
    run = Run(trainer.lightning_module, replay, trainer, data)
    run.steps = record.steps
    return run


def train(root, model_dir, steps, ckpt_path=None, **options) -> Run:
    """Joining from the second pass on; a checkpoint at the end."""
    return fit_placement(root, model_dir, steps, "join", ROWS, RecordSteps(), ckpt_path, **options)


def test_a_held_question_of_the_batch_gets_a_stored_row_in_its_own_group_and_no_question_leaves(
    tmp_path, tiny_model_dir
):
    run = train(tmp_path, tiny_model_dir, 6, mix_fraction=0.5)
    joined = []
    for batch, groups, replayed, held in run.steps:
        # The batch's questions, every one trained in a group of K: none left, none added.
        assert sorted(group[0] for group in groups) == sorted(batch) and len(groups) == BATCH
        assert all(len(set(group)) == 1 for group in groups)
        for row in replayed:  # the stored row opens a group of its own question, one of the batch's held ones
            assert row % K == 0 and groups[row // K][0] in set(batch) & set(held)
        joined.append(len(replayed))
    assert joined[:3] == [0, 0, 0]  # the first pass: the buffer holds none of the batch's questions
    assert all(0 < n <= BATCH // 2 for n in joined[3:])  # mix_fraction 0.5 caps each step at 2
    assert [float(logged(run, "replay/joined_groups")[s]) for s in range(6)] == joined
    assert run.trainer.lightning_module.generated_tokens > 0


def test_bounded_demand_joins_no_more_than_the_batch_holds_in_the_medium_range(tmp_path, tiny_model_dir):
    run = train(tmp_path, tiny_model_dir, 9, mix_fraction=1.0, bounded_demand=True)
    capped = 0
    for batch, groups, replayed, held in run.steps:
        assert sorted(group[0] for group in groups) == sorted(batch)
        medium = sum(0.3 <= held[q] <= 0.7 for q in batch if q in held)
        assert len(replayed) <= medium
        capped += medium < sum(q in held for q in batch)
    assert run.replay.replayed_steps and capped  # joined, and on some step the cap was below the held ones


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    return train(tmp_path_factory.mktemp("straight"), tiny_model_dir, 6)


def test_a_resumed_run_is_the_uninterrupted_run_bitwise(tmp_path, tiny_model_dir, straight, recwarn):
    train(tmp_path / "split", tiny_model_dir, 4)
    resumed = train(tmp_path / "split", tiny_model_dir, 6, ckpt_path="last")
    assert resumed.steps == straight.steps[4:] and any(replayed for _, _, replayed, _ in resumed.steps)
    assert_same(final_state(straight), final_state(resumed))
    assert logged(resumed, "replay/joined_groups") == {
        s: logged(straight, "replay/joined_groups")[s] for s in range(4, 6)
    }
    assert not [w for w in recwarn if "Resuming" in str(w.message)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"placement": "append"}, "placement='append'; allowed: displace, join, refill"),
        ({"placement": "join"}, "placement='join' needs mode='mix'"),
        ({"placement": "refill", "mode": "mix", "displaced_questions": "defer"}, "nothing to defer"),
    ],
)
def test_the_placement_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        ReplayCallback(**options)
    assert ReplayCallback().placement == "displace"


def test_join_puts_every_per_question_entry_of_the_batch_in_the_same_order():
    batch = {"prompt": ["a", "b", "c"], "question_id": torch.tensor([7, 8, 9]), "answer": ("1", "2", "3"),
             "other": "kept"}  # fmt: skip
    put_last(batch, torch.tensor([7, 8]))
    assert batch["prompt"] == ["c", "a", "b"] and batch["question_id"].tolist() == [9, 7, 8]
    assert batch["answer"] == ("3", "1", "2") and batch["other"] == "kept"

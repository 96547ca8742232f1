"""ExGRPOModule(dynamic_sampling=...) in real Trainer runs on a tiny model, no replay: the places of dead
groups (K equal rewards) go to fresh questions from the training stream, which count as seen; "refill" takes
one further round placed whatever its rewards, as replay's refill does with replayed questions, "dapo" takes
rounds of a batch until no dead place is left or the round cap; the counts are logged; a resumed run is the
uninterrupted one bitwise; wrong combinations stop at setup."""

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger
from test_resume import assert_same

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.data import ArithmeticTask, PromptDataModule

ROWS, BATCH, K = 40, 4, 4


class RecordSteps(Callback):
    """Per step: the batch's question ids, each trained group's question ids and rewards, and the question
    ids of the groups that gave way (as groups of K)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts, gave_way = outputs["rollouts"], outputs["gave_way"]
        gave = [] if gave_way is None else gave_way.question_ids.view(-1, K)[:, 0].tolist()
        rewards = rollouts.rewards.view(-1, K)
        self.steps.append(
            SimpleNamespace(
                batch=batch["question_id"].tolist(),
                groups=rollouts.question_ids.view(-1, K)[:, 0].tolist(),
                dead=int((rewards == rewards[:, :1]).all(1).sum()),
                gave=gave,
                metrics=dict(pl_module.last_step_metrics),
                replayed=int(rollouts.replayed.sum()),
            )
        )


def fit(root, model_dir, steps, ckpt_path=None, callbacks=(), **options):
    seed_everything(0)
    record = RecordSteps()
    trainer = Trainer(
        max_steps=steps, max_epochs=100, accelerator="cpu", logger=CSVLogger(root, name="log"),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=root, plugins=[AtomicCheckpointIO()],
        callbacks=[SafeModelCheckpoint(dirpath=root / "checkpoints", save_last="link"), record, *callbacks],
    )  # fmt: skip
    module = tiny_module(model_dir, **options)
    data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return SimpleNamespace(trainer=trainer, module=module, data=data, steps=record.steps)


def test_refill_gives_dead_groups_places_to_as_many_fresh_questions_of_the_stream(tmp_path, tiny_model_dir):
    run = fit(tmp_path, tiny_model_dir, 6, dynamic_sampling="refill", refill_fraction=0.5)
    seen, refilled = [], []
    for step in run.steps:
        assert len(step.groups) == BATCH and step.replayed == 0
        kept = [q for q in step.batch if q not in step.gave]
        drawn = step.groups[len(kept) :]
        assert step.groups[: len(kept)] == kept  # the batch's live groups stay, in order, the new ones follow
        assert len(drawn) == len(step.gave) <= BATCH // 2  # refill_fraction 0.5 caps at 2
        assert step.metrics["train/generation_rounds"] == (2 if drawn else 1)
        assert step.metrics["train/dead_groups_before"] >= len(step.gave)
        assert step.metrics["train/dead_groups_after"] == step.dead  # the new groups, whatever their rewards
        seen += step.batch + drawn
        refilled.append(len(drawn))
    assert any(refilled)
    # The drawn questions are the stream's next ones: no question comes twice before the pass of 40 is over.
    assert len(seen) <= ROWS and len(set(seen)) == len(seen)


def test_dapo_takes_rounds_until_no_dead_place_is_left_or_the_cap(tmp_path, tiny_model_dir):
    run = fit(tmp_path, tiny_model_dir, 5, dynamic_sampling="dapo", max_generation_rounds=3)
    seen = []
    for step in run.steps:
        rounds = step.metrics["train/generation_rounds"]
        assert len(step.groups) == BATCH and 1 <= rounds <= 3
        assert step.dead == step.metrics["train/dead_groups_after"]
        assert step.dead == 0 or rounds == 3  # a dead group is left only when the cap stopped the rounds
        assert (rounds == 1) == (step.metrics["train/dead_groups_before"] == 0)
        drawn = BATCH * (int(rounds) - 1)  # each further round draws a batch of questions
        assert len(step.gave) == drawn  # every sampled group is trained on or gave way: none lost
        seen += step.batch
    assert any(step.metrics["train/generation_rounds"] > 1 for step in run.steps)
    # The batches never repeat the questions the rounds drew (the pass of 40 is not over yet).
    drawn_total = sum(BATCH * (int(s.metrics["train/generation_rounds"]) - 1) for s in run.steps)
    if len(seen) + drawn_total <= ROWS:
        assert len(set(seen)) == len(seen)


def test_off_trains_the_dead_groups_as_they_are_and_logs_the_counts(tmp_path, tiny_model_dir):
    run = fit(tmp_path, tiny_model_dir, 3)
    for step in run.steps:
        assert step.groups == step.batch and step.gave == []
        assert (
            step.metrics["train/dead_groups_before"] == step.metrics["train/dead_groups_after"] == step.dead
        )
        assert step.metrics["train/generation_rounds"] == 1


@pytest.mark.parametrize("mode", ["refill", "dapo"])
def test_a_resumed_run_is_the_uninterrupted_one_bitwise(tmp_path, tiny_model_dir, mode):
    options = {"dynamic_sampling": mode, "max_generation_rounds": 3}
    straight = fit(tmp_path / "straight", tiny_model_dir, 6, **options)
    fit(tmp_path / "resumed", tiny_model_dir, 3, **options)
    resumed = fit(tmp_path / "resumed", tiny_model_dir, 6, tmp_path / "resumed" / "checkpoints" / "last.ckpt",
                  **options)  # fmt: skip
    assert [s.groups for s in resumed.steps] == [s.groups for s in straight.steps[3:]]
    assert_same(resumed.module.policy.state_dict(), straight.module.policy.state_dict())
    assert_same(resumed.trainer.optimizers[0].state_dict()["state"],
                straight.trainer.optimizers[0].state_dict()["state"])  # fmt: skip
    assert_same(resumed.trainer.train_dataloader.state_dict(), straight.trainer.train_dataloader.state_dict())
    assert resumed.module.generated_tokens == straight.module.generated_tokens


class RowsWithoutAStream(LightningDataModule):
    def train_dataloader(self):
        return [{"prompt": ["1+1="], "question_id": torch.tensor([0]), "answer": ["2"]}]


def test_a_datamodule_without_a_stream_is_named_at_setup(tmp_path, tiny_model_dir):
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, default_root_dir=tmp_path)  # fmt: skip
    module = tiny_module(tiny_model_dir, dynamic_sampling="dapo")
    with pytest.raises(TypeError, match="RowsWithoutAStream has no stream_passes or draw_questions"):
        trainer.fit(module, RowsWithoutAStream())


def test_replays_refill_and_dynamic_sampling_together_stop_at_setup(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="placement='refill' with ExGRPOModule dynamic_sampling='refill'"):
        fit(tmp_path, tiny_model_dir, 1, callbacks=[ReplayCallback(mode="mix", placement="refill")],
            dynamic_sampling="refill")  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("dynamic_sampling", "filter", "dynamic_sampling"),
        ("refill_fraction", 0.0, "refill_fraction"),
        ("max_generation_rounds", 0, "max_generation_rounds"),
    ],
)
def test_options_out_of_range_are_named(tiny_model_dir, option, value, message):
    with pytest.raises(ValueError, match=message):
        tiny_module(tiny_model_dir, **{option: value})

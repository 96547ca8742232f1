"""A replay that can never happen is never silent: contradictions of the options are errors before
training, ones that depend on the data a warning at its start, a run that never replayed says so at its
end, and a resume with other replay options lists them."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from test_contract_checks import rows
from test_replay_callback import fit, uniform_replay

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.callbacks.module_checks import check_completion_mask
from exgrpo_pl.callbacks.replay_checks import _batches_left, defaults, options, warn_changed
from exgrpo_pl.contract import ContractError
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
from exgrpo_pl.rewards import FormatReward


@pytest.mark.parametrize("minimum, maximum", [(200_000, 100_000), (2, 1)])
def test_a_minimum_above_the_buffer_size_is_an_error(minimum, maximum):
    with pytest.raises(
        ValueError, match=rf"min_buffer_size={minimum}: must be <= the buffer's max_size={maximum}"
    ):
        ReplayCallback(buffer=TrajectoryBuffer(max_size=maximum), min_buffer_size=minimum)


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("mode", "both", "mode='both'; allowed: swap, mix"),
        ("mix_fraction", 0.0, "mix_fraction=0.0"),
        ("displaced_questions", "drop", "displaced_questions='drop'; allowed: discard, defer"),
        ("bounded_demand", True, "bounded_demand=True needs mode='mix'"),
        ("min_buffer_size", 10**6, "min_buffer_size=1000000: must be <="),
        ("max_consecutive_replay_steps", 0, "max_consecutive_replay_steps=0: must be >= 1"),
    ],
)
def test_an_option_set_after_construction_is_checked_before_the_first_step(
    tmp_path, tiny_model_dir, option, value, message
):
    callback, steps = ReplayCallback(min_buffer_size=1), CountsSteps()
    setattr(callback, option, value)  # as a script adjusting a preset's callback does
    with pytest.raises(ValueError, match=message):
        fit(tmp_path, tiny_model_dir, [callback, steps])
    assert steps.steps == 0


def test_a_pass_rate_trigger_set_after_construction_holds_replay_back(tmp_path, tiny_model_dir):
    callback = ReplayCallback(replay=uniform_replay(), min_buffer_size=1)
    callback.start_pass_rate = 1.0  # no batch of the tiny model is answered entirely right
    _, rollouts = fit(tmp_path, tiny_model_dir, [callback])
    assert not any(step.replayed.any() for step in rollouts) and not callback.pass_rate_reached


class CountsSteps(Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_start(self, *args):
        self.steps += 1


@pytest.mark.parametrize("start, max_epochs", [(2, 2), (5, 2)])
def test_a_start_epoch_past_the_last_epoch_stops_before_the_first_step(
    tmp_path, tiny_model_dir, start, max_epochs
):
    callback, steps = ReplayCallback(replay_start_epoch=start, min_buffer_size=1), CountsSteps()
    with pytest.raises(
        ValueError, match=rf"replay_start_epoch={start}: must be < trainer.max_epochs={max_epochs}"
    ):
        fit(tmp_path, tiny_model_dir, [callback, steps], max_steps=-1, max_epochs=max_epochs)
    assert steps.steps == 0


def test_a_minimum_the_run_cannot_reach_warns_at_the_start_with_the_numbers(tmp_path, tiny_model_dir):
    # 3 steps x 4 questions x 4 generations = 48 rollouts, fewer than the 100 asked for.
    callback = ReplayCallback(replay=uniform_replay(), min_buffer_size=100)
    with pytest.warns(
        UserWarning, match=r"min_buffer_size=100 .* at most 48 on a rank \(3 batches x 4 questions x 4"
    ):
        fit(tmp_path, tiny_model_dir, [callback], max_steps=3)


def test_a_per_question_cap_below_the_minimum_warns(tmp_path, tiny_model_dir):
    # 64 questions, 10% held out: 58 training questions, each storing at most 2 trajectories.
    buffer = TrajectoryBuffer(max_per_question=2)
    callback = ReplayCallback(buffer=buffer, replay=uniform_replay(), min_buffer_size=500)
    with pytest.warns(
        UserWarning, match=r"at most 116 on a rank \(58 training questions x max_per_question=2"
    ):
        fit(tmp_path, tiny_model_dir, [callback], max_steps=200)


def test_max_steps_ending_before_the_start_epoch_warns(tmp_path, tiny_model_dir):
    callback = ReplayCallback(replay=uniform_replay(), replay_start_epoch=1, min_buffer_size=1)
    with pytest.warns(
        UserWarning, match=r"replay_start_epoch=1, but trainer.max_steps=4 ends this run in epoch 0"
    ):
        fit(tmp_path, tiny_model_dir, [callback], max_steps=4)


def test_batches_left_count_a_module_s_updates_per_batch():
    """max_steps counts optimizer updates; a module taking 2 per batch has half as many batches left."""
    module = SimpleNamespace(updates_per_batch=2)
    trainer = SimpleNamespace(
        num_training_batches=100, max_epochs=10, current_epoch=0, max_steps=7, global_step=2,
        accumulate_grad_batches=1, lightning_module=module,
    )  # fmt: skip
    assert _batches_left(trainer) == (3, 3)


def test_an_active_replay_that_never_replayed_says_so_at_the_end(tmp_path, tiny_model_dir):
    # No completion is ever correct, and this buffer keeps correct trajectories only.
    buffer, never = TrajectoryBuffer(keep="correct"), FormatReward("x{99}")
    callback = ReplayCallback(buffer=buffer, replay=uniform_replay(), min_buffer_size=1)
    with pytest.warns(
        UserWarning, match=r"replay was active, but no step of this run replayed \(4 steps fell back"
    ):
        trainer, _ = fit(tmp_path, tiny_model_dir, [callback], max_steps=4, reward=never)
    assert trainer.logged_metrics["replay/replayed_steps"] == 0 and len(buffer) == 0


def test_join_on_a_single_pass_never_replays_and_says_why_at_the_end(tmp_path, tiny_model_dir):
    replay = SelectiveReplay("uniform", 1.0, replayed_trajectories="any_stored_including_incorrect")
    callback = ReplayCallback(replay=replay, mode="mix", placement="join", min_buffer_size=1)
    with pytest.warns(UserWarning, match=r"placement='join' replays only questions of the batch that the"):
        trainer, _ = fit(tmp_path, tiny_model_dir, [callback], max_steps=4)  # within the first pass
    assert len(callback.buffer) and trainer.logged_metrics["replay/joined_groups"] == 0


def test_a_run_that_replayed_warns_nothing_at_its_end(tmp_path, tiny_model_dir, recwarn):
    fit(tmp_path, tiny_model_dir, [ReplayCallback(replay=uniform_replay(0.99), min_buffer_size=1)])
    assert not [w for w in recwarn if "ReplayCallback" in str(w.message)]


def test_options_flatten_the_callback_and_its_parts():
    callback = ReplayCallback(
        buffer=TrajectoryBuffer(max_size=50, bucketer=DifficultyBucketer(window_size=8)),
        mode="mix",
        min_buffer_size=1,
    )
    found = options(callback)
    assert found["mode"] == "mix" and found["buffer.max_size"] == 50
    assert found["buffer.bucketer.window_size"] == 8 and found["replay.replay_probability"] == 0.3
    assert found["buffer.entropy_percentiles"] == [25.0, 50.0, 75.0]
    assert "buffer" not in found and "buffer.bucketer" not in found  # objects are flattened, not kept
    assert "replay.seed" not in found  # the resumed sampler continues its saved generators whatever it is


def test_an_option_a_checkpoint_predates_counts_as_its_default(recwarn):
    """A checkpoint saved before `displaced_questions` existed resumes without a warning, unless this run
    sets it to something else than the behaviour the saved run had."""
    callback = ReplayCallback(mode="mix")
    saved = {k: v for k, v in options(callback).items() if k != "displaced_questions"}
    warn_changed(saved, options(callback), defaults(callback))
    assert not recwarn.list
    deferring = ReplayCallback(mode="mix", displaced_questions="defer")
    with pytest.warns(UserWarning, match="displaced_questions: 'discard' in the checkpoint, 'defer'"):
        warn_changed(saved, options(deferring), defaults(deferring))


def resume(tmp_path, model_dir, callbacks, checkpoint):
    seed_everything(0)
    trainer = Trainer(
        max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, callbacks=callbacks, enable_checkpointing=False,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(tiny_module(model_dir), datamodule=data, ckpt_path=checkpoint)


@pytest.fixture
def saved(tmp_path, tiny_model_dir):
    """A checkpoint of step 2 of a swap-mode run whose pass-rate trigger never fired, and one of a run
    without replay."""
    for name, callbacks in [
        ("replay", [ReplayCallback(replay=uniform_replay(), min_buffer_size=1, start_pass_rate=1.0)]),
        ("grpo", []),
    ]:
        checkpoint = ModelCheckpoint(dirpath=tmp_path / name, save_last=True)
        fit(tmp_path, tiny_model_dir, [*callbacks, checkpoint], max_steps=2, enable_checkpointing=True)
    return tmp_path / "replay" / "last.ckpt", tmp_path / "grpo" / "last.ckpt"


def test_resuming_with_other_replay_options_lists_them(saved, tmp_path, tiny_model_dir):
    changed = ReplayCallback(
        buffer=TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=7)),
        replay=uniform_replay(),
        mode="mix",
        min_buffer_size=1,
        bounded_demand=True,
        displaced_questions="defer",
    )
    with pytest.warns(UserWarning, match=r"5 ReplayCallback option\(s\) differ") as caught:
        resume(tmp_path, tiny_model_dir, [changed], saved[0])
    assert changed.replayed_steps == 1  # no pass-rate trigger in this run: step 3 replays
    (message,) = [str(w.message) for w in caught if "ReplayCallback option" in str(w.message)]
    assert "mode: 'swap' in the checkpoint, 'mix' in this run" in message
    assert "bounded_demand: False in the checkpoint, True in this run" in message
    assert "displaced_questions: 'discard' in the checkpoint, 'defer' in this run" in message
    assert changed.deferred_total > 0  # step 3 deferred what it displaced, into the restored pass
    assert "buffer.bucketer.window_size: 100 in the checkpoint, 7 in this run" in message
    assert "start_pass_rate: 1.0 in the checkpoint, None in this run" in message


def test_resuming_with_the_same_replay_options_warns_nothing(saved, tmp_path, tiny_model_dir, recwarn):
    same = ReplayCallback(replay=uniform_replay(), min_buffer_size=1, start_pass_rate=1.0)
    resume(tmp_path, tiny_model_dir, [same], saved[0])
    assert not [w for w in recwarn if "ReplayCallback" in str(w.message)]


def test_adding_a_replay_callback_to_a_checkpoint_without_one_warns(saved, tmp_path, tiny_model_dir):
    with pytest.warns(UserWarning, match="from a checkpoint saved without one: its buffer starts empty"):
        resume(
            tmp_path, tiny_model_dir, [ReplayCallback(replay=uniform_replay(), min_buffer_size=1)], saved[1]
        )


def test_a_completion_mask_true_after_eos_is_named_with_the_fix():
    """Padding after EOS inside the mask of a fresh row is an error naming the rows and the mask to build;
    a mask that ends at EOS, replayed rows, and an unknown EOS pass."""
    eos = 2
    good = rows([0, 0, 1, 1])
    good.completion_ids = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 9, 9], [5, 5, 5, 2]])
    good.completion_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    good.behaviour_logps = torch.zeros(4, 4)
    check_completion_mask(good, [eos])
    bad = replace(good, completion_mask=torch.ones(4, 4, dtype=torch.bool))  # rows 0 and 2 padded after EOS
    with pytest.raises(
        ContractError, match=r"True after the EOS token \(ids \[2\]\) in rows \[0, 2\] \(5 tokens\)"
    ):
        check_completion_mask(bad, [eos])
    check_completion_mask(replace(bad, replayed=torch.ones(4, dtype=torch.bool)), [eos])
    check_completion_mask(bad, [])

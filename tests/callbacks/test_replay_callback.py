"""ReplayCallback in real Trainer runs on a tiny model: swap, mix, fallbacks, triggers, checkpoints."""

import warnings

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_buffer import group

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.callbacks import ReplayCallback, replay_state
from exgrpo_pl.contract import ContractError
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
from exgrpo_pl.module import ExGRPOModule


class RecordRollouts(Callback):
    """Keeps what every training step trained on."""

    def __init__(self):
        self.rollouts = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts.append(outputs["rollouts"])


def fit(tmp_path, model_dir, callbacks, max_steps=4, reward=None, ckpt_path=None, **trainer_kwargs):
    seed_everything(0)
    module = tiny_module(model_dir, **({"reward_funcs": [reward]} if reward else {}))
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    record = RecordRollouts()
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[*callbacks, record],
        default_root_dir=tmp_path,
        **{"enable_checkpointing": False, **trainer_kwargs},
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, record.rollouts


def uniform_replay(replay_probability=1.0):
    return SelectiveReplay(strategy="uniform", replay_probability=replay_probability)


def test_swap_mode_replaces_whole_batches_after_the_first_step(tmp_path, tiny_model_dir):
    callback = ReplayCallback(replay=uniform_replay(), mode="swap", min_buffer_size=1)
    trainer, rollouts = fit(tmp_path, tiny_model_dir, [callback])
    assert not rollouts[0].replayed.any()  # empty buffer: the first step is on-policy
    for step in rollouts[1:]:
        # Up to B*K stored trajectories, nothing generated; "uniform" takes one per stored question.
        assert step.replayed.all() and step.group_size == 1 and 0 < len(step) <= 4 * 4
    assert callback.replayed_steps == 3
    logged = trainer.logged_metrics
    assert logged["replay/row_fraction"] == logged["replay/question_fraction"] == 1.0
    assert "replay/staleness" in trainer.logged_metrics


def floored_swap():
    """Swap on every step the coin allows (probability 1), at most 2 replay steps in a row."""
    return ReplayCallback(
        replay=uniform_replay(), mode="swap", min_buffer_size=1, max_consecutive_replay_steps=2
    )


def test_swap_at_probability_one_still_generates_after_max_consecutive_replay_steps(tmp_path, tiny_model_dir):
    callback = floored_swap()
    trainer, rollouts = fit(tmp_path, tiny_model_dir, [callback], max_steps=7, log_every_n_steps=1)
    # Step 0 fills the buffer; then 2 replay steps, a fresh one, 2 replay steps, a fresh one.
    assert [bool(step.replayed.all()) for step in rollouts] == [False, True, True, False, True, True, False]
    assert not any(rollouts[i].replayed.any() for i in (0, 3, 6))  # the fresh steps generate K per question
    assert all(len(rollouts[i]) == 16 and rollouts[i].group_size == 4 for i in (0, 3, 6))
    assert (callback.replayed_steps, callback.forced_fresh_steps, callback.fallback_steps) == (4, 2, 1)
    assert trainer.logged_metrics["replay/forced_fresh_steps"] == 2


def test_a_resume_inside_a_run_of_swap_replay_steps_continues_it(tmp_path, tiny_model_dir):
    """Stopped after one replay step of a run of at most 2, the resumed run replays once more and then
    generates, as the uninterrupted run does."""
    straight_callback = floored_swap()
    _, straight = fit(tmp_path / "straight", tiny_model_dir, [straight_callback], max_steps=6)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path / "a", tiny_model_dir, [floored_swap(), checkpoint], max_steps=2, enable_checkpointing=True)
    resumed_callback = floored_swap()
    _, resumed = fit(
        tmp_path / "b",
        tiny_model_dir,
        [resumed_callback],
        max_steps=6,
        ckpt_path=tmp_path / "ckpt" / "last.ckpt",
    )
    replayed = [bool(step.replayed.all()) for step in resumed]
    assert replayed == [bool(step.replayed.all()) for step in straight[2:]] == [True, False, True, True]
    assert resumed_callback.forced_fresh_steps == straight_callback.forced_fresh_steps == 1
    assert resumed_callback.consecutive_replay_steps == straight_callback.consecutive_replay_steps == 2
    for a, b in zip(straight[2:], resumed, strict=True):
        assert torch.equal(a.completion_ids, b.completion_ids)


def test_mix_mode_replays_a_fraction_of_questions_as_groups(tmp_path, tiny_model_dir):
    callback = ReplayCallback(replay=uniform_replay(), mode="mix", mix_fraction=0.5, min_buffer_size=1)
    trainer, rollouts = fit(tmp_path, tiny_model_dir, [callback])
    for step in rollouts[1:]:
        assert len(step) == 16 and step.group_size == 4
        # Two of four questions replayed: exactly one stored row in each of the last two groups.
        assert step.replayed.view(4, 4).sum(1).tolist() == [0, 0, 1, 1]
    assert trainer.logged_metrics["replay/row_fraction"] == pytest.approx(2 / 16)
    assert trainer.logged_metrics["replay/question_fraction"] == pytest.approx(2 / 4)  # mix_fraction
    assert "train/is_weight" in trainer.logged_metrics


def test_too_small_buffer_falls_back_to_on_policy_and_counts_it(tmp_path, tiny_model_dir):
    callback = ReplayCallback(replay=uniform_replay(), mode="swap", min_buffer_size=10_000)
    trainer, rollouts = fit(tmp_path, tiny_model_dir, [callback])
    assert not any(step.replayed.any() for step in rollouts)
    assert callback.fallback_steps == 4
    assert trainer.logged_metrics["replay/fallback_steps"] == 4


def test_pass_rate_trigger_and_start_epoch_hold_replay_back(tmp_path, tiny_model_dir):
    never = ReplayCallback(replay=uniform_replay(), min_buffer_size=1, start_pass_rate=1.0)
    _, rollouts = fit(tmp_path, tiny_model_dir, [never])
    assert not any(step.replayed.any() for step in rollouts) and never.fallback_steps == 0
    later = ReplayCallback(replay=uniform_replay(), min_buffer_size=1, replay_start_epoch=1)
    trainer, rollouts = fit(
        tmp_path, tiny_model_dir, [later], max_steps=-1, max_epochs=2, limit_train_batches=2
    )
    assert [bool(s.replayed.any()) for s in rollouts] == [False, False, True, True]


def _solved_if_starting_with_one_else_format(prompts, completions, **columns):
    return [1.0 if p.startswith("1") else float(c[:1].isdigit()) for p, c in zip(prompts, completions)]


_solved_if_starting_with_one_else_format.in_process = True


@pytest.mark.parametrize("fill_from", ["start", "replay_start"])
def test_fill_from_replay_start_stores_nothing_before_the_switch_but_retires_solved_questions(
    tmp_path, tiny_model_dir, fill_from
):
    """The official pool: the batch whose pass rate triggers replay is not stored, so the first replay step
    finds an empty buffer and stays fresh; questions solved by a whole group retire from the first step."""
    buffer = TrajectoryBuffer(
        max_size=1000, keep="correct_of_partial", bucketer=DifficultyBucketer(window_size=4)
    )
    callback = ReplayCallback(
        buffer=buffer, replay=uniform_replay(), mode="mix", min_buffer_size=1, start_pass_rate=0.0,
        fill_from=fill_from,
    )  # fmt: skip
    sizes = BufferSizes(buffer)
    _, rollouts = fit(
        tmp_path, tiny_model_dir, [callback, sizes], reward=_solved_if_starting_with_one_else_format
    )
    first = rollouts[0]
    solved = {int(q) for q, c in zip(first.question_ids[::4], first.correct.view(-1, 4).all(1)) if c}
    assert solved and solved <= set(buffer.bucketer.retired)  # retired from the first step either way
    replayed = [bool(step.replayed.any()) for step in rollouts]
    if fill_from == "start":
        assert sizes.sizes[0] > 0
        assert replayed == [False, True, True, True] and callback.fallback_steps == 0
    else:
        assert sizes.sizes[0] == 0 and sizes.sizes[1] > 0
        assert replayed == [False, False, True, True] and callback.fallback_steps == 1


class BufferSizes(Callback):
    """The buffer's size after each step (after ReplayCallback has stored the step's rollouts)."""

    def __init__(self, buffer):
        self.buffer, self.sizes = buffer, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.sizes.append(len(self.buffer))


def test_paper_strategy_rescores_entropy_with_the_current_policy(tmp_path, tiny_model_dir):
    replay = SelectiveReplay(strategy="gaussian_lowest_entropy", replay_probability=1.0)
    callback = ReplayCallback(replay=replay, mode="mix", min_buffer_size=1)
    trainer, rollouts = fit(tmp_path, tiny_model_dir, [callback])
    assert trainer.logged_metrics["timing/replay_rescore"] > 0


def test_official_pick_rescores_with_the_modules_official_score(tmp_path, tiny_model_dir):
    replay = SelectiveReplay(
        strategy="gaussian_lowest_entropy",
        trajectory_selection="official_inverted_mask_entropy",
        replay_probability=1.0,
    )
    callback = ReplayCallback(replay=replay, mode="mix", min_buffer_size=1)
    calls = []
    score = ExGRPOModule.score_official_entropy

    def recorded(module, rollouts, num_forwards=None):
        calls.append(len(rollouts))
        return score(module, rollouts, num_forwards)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ExGRPOModule, "score_official_entropy", recorded)
        patch.setattr(ExGRPOModule, "score_entropy", lambda *a, **k: pytest.fail("the paper's score ran"))
        trainer, rollouts = fit(tmp_path, tiny_model_dir, [callback])
    assert calls and callback.replayed_steps > 0
    assert any(step.replayed.any() for step in rollouts)


def test_official_pick_needs_the_modules_official_score(tmp_path, tiny_model_dir):
    replay = SelectiveReplay(trajectory_selection="official_inverted_mask_entropy")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ExGRPOModule, "score_official_entropy", None)
        with pytest.raises(ContractError, match="score_official_entropy.*ReplayMixin"):
            fit(tmp_path, tiny_model_dir, [ReplayCallback(replay=replay, mode="mix")], max_steps=1)


def test_buffer_survives_a_checkpoint_loaded_with_weights_only(tmp_path, tiny_model_dir):
    callback = ReplayCallback(replay=uniform_replay(), min_buffer_size=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, tiny_model_dir, [callback, checkpoint], max_steps=2, enable_checkpointing=True)
    path = tmp_path / "ckpt" / "last.ckpt"
    raw = torch.load(path, weights_only=True)  # tensors and primitives only
    (state,) = [v for k, v in raw["callbacks"].items() if k.startswith("ReplayCallback")]
    assert len(state["ranks"]) == 1

    restored = ReplayCallback(replay=uniform_replay(), min_buffer_size=1)
    restored.load_state_dict(state)
    assert len(restored.buffer) == len(callback.buffer) > 0
    assert restored.replayed_steps == callback.replayed_steps
    sample = lambda cb: cb.replay.sample(cb.buffer, 4).question_ids.tolist()  # noqa: E731
    callback.replay.load_state_dict(state["ranks"][0]["replay"])
    assert sample(restored) == sample(callback)


def saved_states(*saved_ranks):
    """Replay states told apart by their `replayed_steps`, which is the saved rank's number."""
    states = []
    for rank in saved_ranks:
        callback = ReplayCallback()
        callback.replayed_steps = rank
        states.append(callback.state_dict()["ranks"][0])
    return states


@pytest.mark.parametrize(
    "state, rank, world_size, takes, warns",
    [
        ({"ranks": saved_states(0, 1)}, 1, 2, 1, False),  # gathered (DDP, ZeRO 0-2)
        ({"ranks": saved_states(0, 1)}, 0, 1, 0, True),  # fewer ranks: rank 1's buffer is dropped
        ({"ranks": saved_states(0, 1)}, 2, 3, 0, True),  # more ranks: they share saved buffers
        ({"ranks": saved_states(0)}, 1, 2, 0, True),  # a one-process checkpoint goes to every rank
        ({"ranks": saved_states(1), "rank": 1, "world_size": 2}, 1, 2, 1, False),  # ZeRO-3: own file
        ({"ranks": saved_states(0), "rank": 0, "world_size": 2}, 1, 2, 0, True),  # handed rank 0's file
        ({"ranks": saved_states(0), "rank": 0, "world_size": 2}, 3, 4, 0, True),  # ... by more ranks
    ],
)
def test_each_rank_takes_its_own_saved_state_or_warns(monkeypatch, state, rank, world_size, takes, warns):
    monkeypatch.setattr(replay_state, "rank_and_world_size", lambda: (rank, world_size))
    restored = ReplayCallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored.load_state_dict(state)
    assert restored.replayed_steps == takes
    messages = [str(w.message) for w in caught if "ReplayCallback" in str(w.message)]
    assert len(messages) == int(warns)
    if warns:
        assert messages[0].endswith(f"rank {rank} takes saved rank {takes}'s buffer")


def test_retired_questions_leave_on_policy_sampling(tmp_path, tiny_model_dir):
    buffer = TrajectoryBuffer(max_size=1000, bucketer=DifficultyBucketer(retire_from="buffer_and_stream"))
    callback = ReplayCallback(buffer=buffer, replay=uniform_replay(replay_probability=0.0), min_buffer_size=1)

    def starts_with_one(prompts, completions, **columns):  # every rollout of these questions is "correct"
        return [float(p.startswith("1")) for p in prompts]

    starts_with_one.in_process = True  # a local function cannot reach the time limit's worker process

    trainer, rollouts = fit(
        tmp_path,
        tiny_model_dir,
        [callback],
        max_steps=-1,
        max_epochs=3,
        limit_train_batches=4,
        reward=starts_with_one,
    )
    excluded = trainer.datamodule.excluded_question_ids  # as set at the start of the last epoch
    assert excluded and excluded <= set(buffer.bucketer.retired)
    assert all(buffer.bucketer.rates(torch.tensor(sorted(excluded))) == 1.0)
    last_epoch = torch.cat([step.question_ids for step in rollouts[-4:]]).tolist()
    assert not excluded & set(last_epoch)


def _solved_unless_starting_with_one(prompts, completions, **columns):
    return [float(not p.startswith("1")) for p in prompts]


_solved_unless_starting_with_one.in_process = True  # a worker process would import this test module (seconds)


def _retiring_fit(tmp_path, tiny_model_dir, bucketer, max_epochs=2):
    buffer = TrajectoryBuffer(max_size=1000, bucketer=bucketer)
    callback = ReplayCallback(buffer=buffer, replay=uniform_replay(replay_probability=0.0), min_buffer_size=1)
    trainer, rollouts = fit(
        tmp_path,
        tiny_model_dir,
        [callback],
        max_steps=-1,
        max_epochs=max_epochs,
        reward=_solved_unless_starting_with_one,
    )
    return trainer, buffer, rollouts


def test_most_questions_out_of_the_stream_warns_once_with_the_options(tmp_path, tiny_model_dir):
    with pytest.warns(UserWarning, match=r"(\d+) of the (\d+) training questions are retired") as caught:
        bucketer = DifficultyBucketer(retire_from="buffer_and_stream")
        trainer, buffer, _ = _retiring_fit(tmp_path, tiny_model_dir, bucketer)
    messages = [str(w.message) for w in caught if "training questions are retired" in str(w.message)]
    assert (
        len(messages) == 1 and "retire_from='buffer'" in messages[0] and "readmit_after_epochs" in messages[0]
    )
    pool = len(trainer.datamodule.train_rows)
    assert 2 * len(trainer.datamodule.excluded_question_ids) > pool


def test_retire_from_buffer_keeps_solved_questions_in_the_stream(tmp_path, tiny_model_dir):
    bucketer = DifficultyBucketer(retire_from="buffer")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*training questions are retired")
        trainer, buffer, rollouts = _retiring_fit(tmp_path, tiny_model_dir, bucketer)
    assert buffer.bucketer.retired and not trainer.datamodule.excluded_question_ids
    second_epoch = {q for step in rollouts[len(rollouts) // 2 :] for q in step.question_ids.tolist()}
    assert second_epoch & buffer.bucketer.retired  # drawn again, and solved again: still retired


def test_readmitted_questions_return_to_the_stream(tmp_path, tiny_model_dir):
    bucketer = DifficultyBucketer(retire_from="buffer_and_stream", readmit_after_epochs=2)
    trainer, buffer, rollouts = _retiring_fit(tmp_path, tiny_model_dir, bucketer, max_epochs=3)
    steps = len(rollouts) // 3
    epochs = [
        {q for step in rollouts[i * steps : (i + 1) * steps] for q in step.question_ids.tolist()}
        for i in range(3)
    ]
    solved_first = {q for q in epochs[0] if bucketer.rates(torch.tensor([q])).item() == 1.0}
    assert solved_first and not solved_first & epochs[1]  # out for epoch 1
    assert solved_first & epochs[2]  # back in epoch 2


def test_bounded_demand_replays_at_most_the_medium_supply(tmp_path, tiny_model_dir):
    buffer = TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4, retire_from=None))
    callback = ReplayCallback(buffer=buffer, mode="mix", mix_fraction=0.75, bounded_demand=True)
    # rates 0, .25, .5, .75, 1: only the question at .5 lies in the medium range (0.3, 0.7)
    buffer.add(RolloutBatch.cat([group(q, q, 4) for q in range(5)]))
    eight = {"prompt": ["q"] * 8, "question_id": torch.arange(8)}
    assert callback._demand(eight, k=4) == 1
    assert ReplayCallback(buffer=buffer, mode="mix", mix_fraction=0.75)._demand(eight, k=4) == 6
    assert ReplayCallback(buffer=TrajectoryBuffer(), mode="mix", bounded_demand=True)._demand(eight, 4) == 0
    with pytest.raises(ValueError, match="bounded_demand=True needs mode='mix'"):
        ReplayCallback(mode="swap", bounded_demand=True)


class RecordSupply(Callback):
    """The replay callback's medium-range supply before each step (placed before it, runs first)."""

    def __init__(self, replay_callback):
        self.replay_callback, self.supply = replay_callback, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        replay = self.replay_callback
        self.supply.append(replay.buffer.num_questions_in(replay.replay.medium_range(replay.buffer)))


def test_bounded_demand_in_a_run_replays_the_supply_or_falls_back(tmp_path, tiny_model_dir):
    narrow = SelectiveReplay(strategy="uniform", replay_probability=1.0, medium_difficulty_range=(0.2, 0.8))
    callback = ReplayCallback(replay=narrow, mode="mix", min_buffer_size=1, bounded_demand=True)
    supply = RecordSupply(callback)
    _, rollouts = fit(tmp_path, tiny_model_dir, [supply, callback], max_steps=8)
    replayed = [int(step.replayed.sum()) for step in rollouts]
    assert replayed == [min(2, s) for s in supply.supply]  # the rho share of 4 questions, or the supply
    assert callback.fallback_steps == sum(s == 0 for s in supply.supply)
    assert 0 < callback.fallback_steps and callback.replayed_steps > 0  # both cases happened


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "both"}, "allowed: swap, mix"),
        ({"mix_fraction": 1.5}, "mix_fraction=1.5"),
        ({"start_pass_rate": -0.1}, "start_pass_rate=-0.1"),
        ({"min_buffer_size": 0}, "min_buffer_size=0"),
        ({"fill_from": "switch"}, "fill_from='switch'; allowed: start, replay_start"),
        ({"max_consecutive_replay_steps": 0}, "max_consecutive_replay_steps=0: must be >= 1"),
        ({"max_consecutive_replay_steps": None}, "max_consecutive_replay_steps=None: must be an integer"),
        ({"replay": SelectiveReplay(entropy_percentile=10)}, "entropy_percentile=10 is not one of"),
    ],
)
def test_bad_settings_are_rejected_before_training(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplayCallback(**kwargs)

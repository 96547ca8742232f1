"""Exact resume: N steps straight == N/2 steps, a checkpoint, then the rest, bitwise (weights, optimizer
state, replay buffer, replay/sampling/data generators and position, logged rewards): stopped mid-epoch and
at an epoch's end, in swap and mix mode, with a finite `max_epochs` (as every shipped config) and without,
and from the newest complete checkpoint after a SIGKILL; every shipped config as it is through `exgrpo fit`
(slow). Also the pieces: the step count that sets no loader up, `resumable_fit_progress`, the per-rank RNG
states, and the warnings where a resume cannot be exact."""

import csv
import math
import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.checkpoints.resume import (
    estimated_stepping_batches,
    restore_rng_states,
    resumable_fit_progress,
    rng_states,
    use_run_optimizer_options,
)
from exgrpo_pl.cli import main
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
from exgrpo_pl.module import ExGRPOModule

ROWS, BATCH, STEPS = 12, 4, 6  # 3 steps an epoch, fewer once questions are retired
SHIPPED_MAX_EPOCHS = 100  # every shipped config's: the step count then needs the epoch length
CONFIGS = Path(__file__).parents[2] / "configs"
SHIPPED = ["quickstart", "quickstart_reasoning", "exgrpo_paper", "exgrpo_swap", "grpo_baseline"]


@dataclass
class Run:
    module: ExGRPOModule
    replay: ReplayCallback
    trainer: Trainer
    data: PromptDataModule


def train(
    root: Path, model_dir, mode, steps, ckpt_path=None, callbacks=(), max_epochs=SHIPPED_MAX_EPOCHS,
    module=None, **checkpointing,
) -> Run:  # fmt: skip
    """The tiny GRPO module (or `module`) with replay from the first step and retirement after 2 solved
    rollouts."""
    seed_everything(0)
    module = module or tiny_module(model_dir)
    replay = ReplayCallback(
        mode=mode,
        min_buffer_size=1,
        replay=SelectiveReplay("uniform", replay_probability=0.5),
        buffer=TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4, retire_from="buffer_and_stream")),
    )
    checkpoint = SafeModelCheckpoint(dirpath=root / "checkpoints", save_last="link", **checkpointing)
    trainer = Trainer(
        max_steps=steps, max_epochs=max_epochs, accelerator="cpu", logger=CSVLogger(root, name="log"),
        log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
        plugins=[AtomicCheckpointIO()], callbacks=[replay, checkpoint, *callbacks],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return Run(module, replay, trainer, data)


def final_state(run: Run) -> dict:
    """Everything a later step depends on."""
    optimizer = run.trainer.optimizers[0].state_dict()
    return {
        "weights": run.module.policy.state_dict(),
        "optimizer": optimizer["state"],
        "learning_rate": [group["lr"] for group in optimizer["param_groups"]],
        "buffer": run.replay.buffer.state_dict(),
        "replay_generators": run.replay.replay.state_dict(),
        "sampling_generator": torch.get_rng_state(),
        "data": run.trainer.train_dataloader.state_dict(),
        "retired": sorted(run.data.excluded_question_ids),
        "counters": [
            run.replay.replayed_steps,
            run.replay.fallback_steps,
            run.replay.pass_rate_reached,
            run.replay.consecutive_replay_steps,
            run.replay.forced_fresh_steps,
        ],
        "tokens": [run.module.generated_tokens, run.module.num_tokens],
        "progress": [run.trainer.global_step, run.trainer.current_epoch],
    }


def logged(run: Run, key="train/reward") -> dict[int, str]:
    with open(os.path.join(run.trainer.logger.log_dir, "metrics.csv")) as file:
        return {int(row["step"]): row[key] for row in csv.DictReader(file) if row.get(key)}


def assert_same(a, b, path="state"):
    """Equal structure, bitwise-equal tensors."""
    assert type(a) is type(b), path
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model_dir):
    """The uninterrupted run of each mode, trained once for all the tests that compare with it."""
    runs = {}

    def get(mode, max_epochs=SHIPPED_MAX_EPOCHS):
        if (mode, max_epochs) not in runs:
            root = tmp_path_factory.mktemp(f"straight-{mode}")
            run = train(root, tiny_model_dir, mode, STEPS, max_epochs=max_epochs)
            runs[mode, max_epochs] = (final_state(run), logged(run), run)
        return runs[mode, max_epochs]

    return get


def check_resumed(straight_run, resumed: Run, stop: int) -> None:
    state, rewards, run = straight_run
    assert_same(state, final_state(resumed))
    assert resumed.replay.replayed_steps > 0 and resumed.data.excluded_question_ids
    resumed_rewards = logged(resumed)
    assert sorted(resumed_rewards) == list(range(stop, STEPS))
    assert resumed_rewards == {step: rewards[step] for step in range(stop, STEPS)}
    assert logged(resumed, "epoch") == {step: logged(run, "epoch")[step] for step in range(stop, STEPS)}


@pytest.mark.parametrize("max_epochs", [SHIPPED_MAX_EPOCHS, -1], ids=["max_epochs=100", "max_epochs=-1"])
@pytest.mark.parametrize("mode", ["swap", pytest.param("mix", marks=pytest.mark.slow)])
@pytest.mark.parametrize("stop", [3, 4], ids=["at the end of epoch 0", "mid epoch 1"])
def test_a_resumed_run_is_the_uninterrupted_run_bitwise(
    tmp_path, tiny_model_dir, straight, mode, stop, max_epochs, recwarn
):
    first = train(tmp_path, tiny_model_dir, mode, stop, max_epochs=max_epochs)
    # Questions were retired before the stop: epoch 1 leaves them out, in both runs.
    assert first.replay.buffer.bucketer.retired and first.replay.replayed_steps > 0
    resumed = train(tmp_path, tiny_model_dir, mode, STEPS, ckpt_path="last", max_epochs=max_epochs)
    check_resumed(straight(mode, max_epochs), resumed, stop)
    assert not [w for w in recwarn if "Resuming" in str(w.message)]  # nothing to warn about


def test_a_loader_set_up_before_the_checkpoint_is_restored_is_reported(tmp_path, tiny_model_dir):
    train(tmp_path, tiny_model_dir, "swap", 4)
    module = tiny_module(tiny_model_dir)
    configure_optimizers = module.configure_optimizers

    def reads_the_step_count_first():
        assert module.trainer.estimated_stepping_batches > 0  # Lightning's: sets the training loader up
        return configure_optimizers()

    module.configure_optimizers = reads_the_step_count_first
    with pytest.warns(UserWarning, match="saved pass and position were not loaded"):
        train(tmp_path, tiny_model_dir, "swap", STEPS, ckpt_path="last", module=module)


@pytest.mark.slow
@pytest.mark.parametrize("config", SHIPPED)
def test_a_shipped_config_as_it_is_resumes_bitwise(tmp_path, config):
    """`exgrpo fit` with only `max_steps` changed (`max_epochs` as shipped): 8 steps straight against 4, a
    checkpoint and `--ckpt_path last` (whole batches for every preset: the paper preset takes 2 updates a
    batch, and a max_steps between two batches is refused)."""
    straight = fit_shipped(config, tmp_path / "straight", 8)
    fit_shipped(config, tmp_path / "split", 4)
    resumed = fit_shipped(config, tmp_path / "split", 8, resume=True)
    assert straight["global_step"] == resumed["global_step"] == 8
    keys = ["state_dict", "optimizer_states", "lr_schedulers", "sampling_rng", "token_counts", "loops"]
    for key in [*keys, "PromptDataModule"]:
        assert_same(straight[key], resumed[key], key)
    assert_same(replay_state(straight), replay_state(resumed), "replay")


def fit_shipped(config: str, root: Path, steps: int, resume: bool = False) -> dict:
    """Runs `exgrpo fit` on configs/<config>.yaml with `max_steps=steps`; returns its last checkpoint."""
    main([
        "fit", "--config", str(CONFIGS / f"{config}.yaml"), f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}", "--trainer.enable_progress_bar=false",
        *(["--ckpt_path=last"] if resume else []),
    ])  # fmt: skip
    runs = (root / "lightning_logs").glob(f"{config}-s*")  # `<config>-s0`, then `-v1`, ...: the newest
    newest = max(runs, key=lambda p: (p / "checkpoints" / "last.ckpt").stat().st_mtime)
    return torch.load(newest / "checkpoints" / "last.ckpt", weights_only=True)


def replay_state(checkpoint: dict) -> dict | None:
    """The ReplayCallback's state (buffer, generators, counters), None without one."""
    return next((v for k, v in checkpoint["callbacks"].items() if "ReplayCallback" in k), None)


class KillDuringStep(Callback):
    """SIGKILLs its own process in the middle of training step `step` (after generation, before the
    update): nothing of that step is saved."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def _killed_run(root, model_dir, mode, step) -> None:
    torch.set_num_threads(1)
    train(Path(root), model_dir, mode, STEPS, callbacks=[KillDuringStep(step)], every_n_train_steps=1)


def test_after_a_sigkill_the_newest_complete_checkpoint_resumes_bitwise(tmp_path, tiny_model_dir, straight):
    kill_at = 4  # mid epoch 1, so the checkpoint holds a position inside a pass
    process = multiprocessing.get_context("fork").Process(
        target=_killed_run, args=(str(tmp_path), tiny_model_dir, "swap", kill_at)
    )
    process.start()
    process.join(300)
    assert process.exitcode == -signal.SIGKILL
    resumed = train(tmp_path, tiny_model_dir, "swap", STEPS, ckpt_path="last")
    check_resumed(straight("swap"), resumed, kill_at)


# The pieces


def progress(checkpoint):
    loop = checkpoint["loops"]["fit_loop"]
    epochs, batches = loop["epoch_progress"]["total"], loop["epoch_loop.batch_progress"]
    return (
        [epochs[k] for k in ("ready", "started", "processed", "completed")],
        [batches["total"][k] for k in ("ready", "started", "processed", "completed")],
        [batches["current"][k] for k in ("ready", "started", "processed", "completed")],
        batches["is_last_batch"],
        loop["epoch_loop.state_dict"]["_batches_that_stepped"],
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_model_dir):
    """Checkpoints saved at step 2 (mid epoch 0) and step 3 (its last batch) by each hook that saves."""
    root = tmp_path_factory.mktemp("kinds")

    class SaveAtTrainEnd(Callback):
        def on_train_end(self, trainer, pl_module):
            trainer.save_checkpoint(root / f"end-step={trainer.global_step}.ckpt")

    for steps in (2, 3):
        seed_everything(0)
        trainer = Trainer(
            max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, default_root_dir=root, callbacks=[
                SafeModelCheckpoint(root, "batch-{step}", every_n_train_steps=1, save_top_k=-1),
                SafeModelCheckpoint(root, "epoch-{step}", save_top_k=-1), SaveAtTrainEnd(),
            ],
        )  # fmt: skip
        data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
        trainer.fit(tiny_module(tiny_model_dir, num_generations=2, max_completion_length=2), data)
    return lambda name: torch.load(root / f"{name}.ckpt", weights_only=True)


def test_checkpoints_saved_mid_epoch_get_the_on_train_batch_end_progress(saved):
    batch, epoch, end = saved("batch-step=2"), saved("epoch-step=2"), saved("end-step=2")
    resumable = ([1, 1, 0, 0], [2, 2, 2, 1], [2, 2, 2, 1], False, 1)  # what Lightning resumes exactly from
    assert progress(batch) == resumable
    assert progress(epoch) == ([1, 1, 1, 0], [2, 2, 2, 2], [2, 2, 2, 2], False, 2)
    assert progress(end) == ([1, 1, 1, 1], [2, 2, 2, 2], [2, 2, 2, 2], False, 2)
    for checkpoint in (epoch, end):
        assert resumable_fit_progress(checkpoint) == "mid-epoch"
        assert progress(checkpoint) == resumable
        assert resumable_fit_progress(checkpoint) is None  # once only
    assert resumable_fit_progress(batch) is None
    assert resumable_fit_progress({"state_dict": {}}) is None  # a weights-only checkpoint


def test_checkpoints_saved_at_an_epochs_end_get_the_progress_of_the_next_epochs_start(saved):
    batch, epoch, end = saved("batch-step=3"), saved("epoch-step=3"), saved("end-step=3")
    assert progress(batch) == ([1, 1, 0, 0], [3, 3, 3, 2], [3, 3, 3, 2], True, 2)
    assert progress(epoch) == ([1, 1, 1, 0], [3, 3, 3, 3], [3, 3, 3, 3], True, 3)
    assert progress(end) == ([1, 1, 1, 1], [3, 3, 3, 3], [3, 3, 3, 3], True, 3)
    for checkpoint in (batch, epoch, end):
        val = checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]["total"]
        val.update(ready=2, started=2, processed=2, completed=2)  # as if the epoch had validated twice
        assert resumable_fit_progress(checkpoint) == "epoch end"
        assert progress(checkpoint) == ([1, 1, 1, 1], [3, 3, 3, 3], [0, 0, 0, 0], False, 3)
        assert set(val.values()) == {0}  # zeroed, as the next epoch's start zeroes them
        assert resumable_fit_progress(checkpoint) is None


@pytest.mark.parametrize(
    "limits",
    [
        dict(max_epochs=3),
        dict(max_epochs=3, max_steps=40),
        dict(max_epochs=2, limit_train_batches=0.5),
        dict(max_epochs=2, limit_train_batches=5),
        dict(max_epochs=2, accumulate_grad_batches=3),
        dict(max_epochs=-1, max_steps=7),
    ],
)
def test_the_step_count_is_lightnings_without_setting_the_loader_up(tmp_path, limits):
    class Counting(BoringModel):
        def configure_optimizers(self):
            ours = estimated_stepping_batches(self.trainer)
            self.counted = (ours, self.trainer.train_dataloader, self.trainer.estimated_stepping_batches)
            return super().configure_optimizers()

    model = Counting()
    Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path, **limits,
    ).fit(model)  # fmt: skip
    ours, loader_then, lightnings = model.counted
    assert loader_then is None and ours == lightnings and math.isfinite(ours)


def test_rng_states_of_another_number_of_ranks_warn_that_the_resume_is_not_exact():
    saved = {"cpu": [torch.get_rng_state()] * 2, "cuda": [None, None]}
    with pytest.warns(UserWarning, match=r"saved by 2 rank\(s\) are resumed by 1"):
        restore_rng_states(saved)


def test_rng_states_round_trip_on_one_process():
    torch.manual_seed(3)
    states = rng_states()
    assert len(states["cpu"]) == len(states["cuda"]) == 1
    expected = torch.rand(4)
    torch.manual_seed(4)
    restore_rng_states(states)
    assert torch.equal(torch.rand(4), expected)


def test_a_run_learning_rate_reaches_what_the_schedule_reports():
    """`use_run_optimizer_options` sets torch's private `LambdaLR._last_lr`: `get_last_lr()` must read it."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([weight], lr=1.0, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    use_run_optimizer_options(optimizer, scheduler, learning_rate=0.2, weight_decay=0.1)
    assert scheduler.get_last_lr() == [0.1] and optimizer.param_groups[0]["lr"] == 0.1
    assert optimizer.param_groups[0]["weight_decay"] == 0.1

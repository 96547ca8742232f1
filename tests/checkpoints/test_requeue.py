"""Resuming on a cluster: under SLURM, `exgrpo fit` turns Lightning's auto-requeue (a checkpoint saved from a
signal handler mid-step) off, and a requeued job resumes from the newest complete checkpoint, bitwise; ranks
that resolve `ckpt_path="last"` to different checkpoints all stop with an error naming each one's."""

import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy
from test_resume import assert_same, replay_state

from exgrpo_pl.checkpoints import SafeModelCheckpoint
from exgrpo_pl.cli import ExGRPOCLI, main
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.lightning_internals import cluster_environment
from exgrpo_pl.module import ExGRPOModule

# What SLURM sets for one task of job 4242 (`srun` inside `sbatch`); SLURMEnvironment.detect() reads them.
SLURM = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "exgrpo", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "127.0.0.1",
}  # fmt: skip
TESTS = Path(__file__).parents[1]


@pytest.fixture
def slurm(monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    return monkeypatch


def cli_args(model_dir, root, steps=2) -> list[str]:
    """`exgrpo fit` on the tiny model with replay from the first step and a checkpoint after every step."""
    return [
        f"--model.model_name_or_path={model_dir}", "--model.num_generations=2",
        "--model.max_completion_length=3",
        "--data.synthetic=exgrpo_pl.data.ArithmeticTask", "--data.synthetic.num_questions=24",
        "--data.batch_size=4", "--data.val_fraction=0", "--trainer.accelerator=cpu", "--trainer.devices=1",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}", "--seed_everything=0",
        "--trainer.callbacks+=exgrpo_pl.callbacks.ReplayCallback", "--trainer.callbacks.mode=mix",
        "--trainer.callbacks.min_buffer_size=1",
        "--trainer.callbacks+=exgrpo_pl.checkpoints.SafeModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=link",
    ]  # fmt: skip


def test_under_slurm_lightnings_auto_requeue_is_off(slurm, tiny_model_dir, tmp_path):
    trainer = ExGRPOCLI(
        ExGRPOModule, PromptDataModule, run=False, args=cli_args(tiny_model_dir, tmp_path)
    ).trainer
    environment = cluster_environment(trainer)
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue is False


def test_a_configured_auto_requeue_is_refused(slurm, tiny_model_dir, tmp_path):
    plugin = ["--trainer.plugins=lightning.pytorch.plugins.environments.SLURMEnvironment"]
    with pytest.raises(
        ValueError, match=r"SLURMEnvironment\(auto_requeue=True\) saves a checkpoint .* middle"
    ):
        ExGRPOCLI(
            ExGRPOModule, PromptDataModule, run=False, args=[*cli_args(tiny_model_dir, tmp_path), *plugin]
        )


def test_an_hpc_checkpoint_left_in_the_root_folder_is_refused_not_loaded(slurm, tiny_model_dir, tmp_path):
    main(["fit", *cli_args(tiny_model_dir, tmp_path / "run")])
    hpc = tmp_path / "hpc_ckpt_1.ckpt"  # what Lightning's requeue handler wrote, mid-step
    hpc.write_bytes(
        (tmp_path / "run" / "lightning_logs" / "run-s0-job4242" / "checkpoints" / "last.ckpt").read_bytes()
    )
    with pytest.raises(ValueError, match=f"{hpc}: Lightning's auto-requeue wrote it in the middle"):
        main(["fit", *cli_args(tiny_model_dir, tmp_path, steps=3)])


def test_a_requeued_job_without_ckpt_path_resumes_from_the_newest_complete_checkpoint_and_says_so(
    slurm, tiny_model_dir, tmp_path, capsys
):
    main(["fit", *cli_args(tiny_model_dir, tmp_path)])
    slurm.setenv("SLURM_RESTART_COUNT", "1")
    main(["fit", *cli_args(tiny_model_dir, tmp_path, steps=3)])
    checkpoints = tmp_path / "lightning_logs" / "run-s0-job4242" / "checkpoints"  # no config, seed 0, the job
    out = capsys.readouterr().out
    saved = checkpoints / "epoch=0-step=2.ckpt"
    assert f"SLURM requeued job 4242 (restart 1) with no --ckpt_path: resuming from {saved}" in out
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 3


class RequeueSignalDuringStep(Callback):
    """Sends this process the requeue signal in the middle of a step (after its rollouts, before its
    backward), as `#SBATCH --signal=USR1@90` may; then kills it, as SLURM does once it requeues the job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_requeue_signal_mid_step_then_a_restart_without_ckpt_path_is_the_uninterrupted_run(
    slurm, tiny_model_dir, tmp_path, capsys
):
    steps, signalled = 6, 4
    main(["fit", *cli_args(tiny_model_dir, tmp_path / "straight", steps)])
    straight = torch.load(next((tmp_path / "straight").rglob("last.ckpt")), weights_only=True)

    root = tmp_path / "requeued"
    callback = [
        "--trainer.callbacks+=test_requeue.RequeueSignalDuringStep",
        f"--trainer.callbacks.step={signalled}",
    ]
    paths = [str(TESTS), str(TESTS / "checkpoints"), os.environ.get("PYTHONPATH", "")]
    child = subprocess.run(
        [sys.executable, "-m", "exgrpo_pl.cli", "fit", *cli_args(tiny_model_dir, root, steps), *callback],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode < 0, child.stderr[-3000:]  # ended by a signal, as a requeued job is
    (saved,) = root.rglob(f"*step={signalled}.ckpt")  # the last step completed before the signal
    slurm.setenv("SLURM_RESTART_COUNT", "1")
    main(["fit", *cli_args(tiny_model_dir, root, steps)])
    resumed = torch.load(next(root.rglob("last.ckpt")), weights_only=True)
    keys = ["state_dict", "optimizer_states", "lr_schedulers", "sampling_rng", "token_counts"]
    for key in [*keys, "PromptDataModule"]:
        assert_same(straight[key], resumed[key], key)
    assert_same(replay_state(straight), replay_state(resumed), "replay")
    assert f"resuming from {saved}, the newest complete checkpoint" in capsys.readouterr().out
    assert not list(root.glob("hpc_ckpt_*"))  # Lightning's mid-step file was never written


class LookElsewhereOnRankOne(SafeModelCheckpoint):
    """A checkpoint callback that, on rank 1, sees an empty folder: a node that does not share the run's."""

    def __init__(self, dirpath, empty) -> None:
        super().__init__(dirpath=dirpath, every_n_train_steps=1)
        self.empty = str(empty)

    def _checkpoint_dirs(self, trainer):
        # Forked ranks know their rank from LOCAL_RANK only, until the strategy sets the process group up.
        return [self.empty] if os.environ.get("LOCAL_RANK") == "1" else super()._checkpoint_dirs(trainer)


def fit_two_ranks(root, model_dir, callback, ckpt_path=None) -> None:
    trainer = Trainer(
        accelerator="cpu", devices=2,
        strategy=DDPStrategy(start_method="fork", timeout=timedelta(seconds=30)),
        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[callback], default_root_dir=root,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(16, seed=1), batch_size=2, val_fraction=0.0)
    trainer.fit(tiny_module(model_dir, num_generations=2, max_completion_length=3), data, ckpt_path=ckpt_path)


@pytest.mark.multiprocess
def test_ranks_that_would_resume_from_different_checkpoints_stop_naming_each(tmp_path, tiny_model_dir):
    shared, empty = tmp_path / "shared", tmp_path / "node2"
    empty.mkdir()
    fit_two_ranks(tmp_path, tiny_model_dir, SafeModelCheckpoint(dirpath=shared, every_n_train_steps=1))
    with pytest.raises(Exception, match="would resume from different checkpoints") as raised:
        fit_two_ranks(tmp_path, tiny_model_dir, LookElsewhereOnRankOne(shared, empty), ckpt_path="last")
    message = str(raised.value)
    assert f"rank 0 on {socket.gethostname()}: {shared / 'epoch=0-step=2.ckpt'}" in message
    assert f"rank 1 on {socket.gethostname()}: none found in ['{empty}']" in message
    assert "filesystem shared by all nodes" in message

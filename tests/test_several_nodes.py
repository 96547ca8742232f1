"""Two nodes on one machine: two `torchrun` launchers (one process each, gloo on the CPU) train with replay;
one node is killed mid-run, both are restarted with `--ckpt_path last`, and the run ends bitwise where the
uninterrupted one does (docs/several-nodes.md)."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from test_resume import assert_same, replay_state

TESTS = Path(__file__).parent
STEPS, KILLED_AT = 6, 3

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


class KillNodeOne(Callback):
    """SIGKILLs the process of node 1 in the middle of a step (after its rollouts, before its backward)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step and os.environ.get("GROUP_RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_nodes(model_dir, root: Path, *extra: str) -> list[subprocess.CompletedProcess]:
    """`exgrpo fit` on two torchrun "nodes" of one CPU process each, replay from the first step, a checkpoint
    every step in `root`/ckpts; waits for both."""
    endpoint = f"127.0.0.1:{free_port()}"
    fit = [
        "-m", "exgrpo_pl.cli", "fit", f"--model.model_name_or_path={model_dir}", "--model.num_generations=2",
        "--model.max_completion_length=3", "--data.synthetic=exgrpo_pl.data.ArithmeticTask",
        "--data.synthetic.num_questions=24", "--data.batch_size=2", "--data.val_fraction=0",
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=2", "--trainer.strategy=ddp",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--seed_everything=0",
        f"--trainer.max_steps={STEPS}", f"--trainer.default_root_dir={root}",
        "--trainer.callbacks+=exgrpo_pl.callbacks.ReplayCallback", "--trainer.callbacks.mode=mix",
        "--trainer.callbacks.min_buffer_size=1",
        "--trainer.callbacks+=exgrpo_pl.checkpoints.SafeModelCheckpoint",
        f"--trainer.callbacks.dirpath={root}/ckpts",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_last=link", *extra,
    ]  # fmt: skip
    paths = [str(TESTS), str(TESTS / "checkpoints"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={rank}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                *fit,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    return [
        subprocess.CompletedProcess(node.args, node.wait(timeout=300), node.stdout.read()) for node in nodes
    ]


def test_a_node_killed_mid_run_then_both_restarted_with_last_is_the_uninterrupted_run(
    tiny_model_dir, tmp_path
):
    straight = two_nodes(tiny_model_dir, tmp_path / "straight")
    assert [node.returncode for node in straight] == [0, 0], straight[1].stdout[-3000:]

    root = tmp_path / "killed"
    killed = two_nodes(
        tiny_model_dir,
        root,
        "--trainer.callbacks+=test_several_nodes.KillNodeOne",
        f"--trainer.callbacks.step={KILLED_AT}",
    )
    assert all(node.returncode != 0 for node in killed)  # node 1 killed, node 0 lost its peer
    assert (root / "ckpts" / f"epoch=0-step={KILLED_AT}.ckpt").exists()
    resumed = two_nodes(tiny_model_dir, root, "--ckpt_path=last")
    assert [node.returncode for node in resumed] == [0, 0], resumed[0].stdout[-3000:]

    final = [
        torch.load(run / "ckpts" / "last.ckpt", weights_only=True) for run in (tmp_path / "straight", root)
    ]
    assert final[0]["global_step"] == final[1]["global_step"] == STEPS
    for key in [
        "state_dict",
        "optimizer_states",
        "lr_schedulers",
        "sampling_rng",
        "token_counts",
        "PromptDataModule",
    ]:
        assert_same(final[0][key], final[1][key], key)
    states = [replay_state(checkpoint) for checkpoint in final]
    assert len(states[0]["ranks"]) == 2  # both nodes' buffers, each resumed by its own rank
    assert_same(states[0], states[1], "replay")

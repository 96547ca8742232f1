"""TRL's reward protocol in real runs: rewards reading `completion_ids` and `trainer_state`, and an `async
def` one, train under `exgrpo fit` within the time limit, their `log_metric` values reaching the logger; a
reward defined in the user's own script trains under the limit; a reward that cannot reach the worker
process stops the run at setup, before the model is loaded. TRL's own six rewards: test_trl_rewards.py."""

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from conftest import tiny_module
from lightning.pytorch import Trainer

from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import RewardNotSendableError

REPO = Path(__file__).resolve().parents[2]


def fit(args):
    """`exgrpo fit` with `args`, returning the CLI object (its trainer and module)."""
    return ExGRPOCLI(
        ExGRPOModule, PromptDataModule, save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False, args=["fit", *args],
    )  # fmt: skip


def tiny_args(model_dir, tmp_path):
    return [
        f"--model.model_name_or_path={model_dir}", "--model.num_generations=2",
        "--model.max_completion_length=3", "--data.synthetic=exgrpo_pl.data.ArithmeticTask",
        "--data.synthetic.num_questions=40", "--data.batch_size=4", "--trainer.accelerator=cpu",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=2",
    ]  # fmt: skip


def test_rewards_reading_ids_and_state_and_an_async_one_train_under_exgrpo_fit(tiny_model_dir, tmp_path):
    names = ["length_reward", "progress_reward", "judge_reward"]
    funcs = "[" + ", ".join(f"protocol_rewards.{name}" for name in names) + "]"
    cli = fit([*tiny_args(tiny_model_dir, tmp_path), f"--model.reward_funcs={funcs}"])
    assert cli.model.hparams.reward_timeout_seconds == 600  # the default limit: they ran in the worker
    logged = cli.trainer.callback_metrics  # the last step's (step 1 of 2)
    assert logged["train/rewards/length_reward/mean"] == logged["train/completions/mean_length"]
    assert logged["train/rewards/progress_reward/mean"] == 1 / 2  # global_step 1 of max_steps 2
    assert logged["train/progress_epoch"] == pytest.approx(1 / cli.trainer.num_training_batches)
    assert logged["train/rewards/judge_reward/mean"] == 0.5 and logged["train/judge_calls"] == 1.0


SCRIPT = """
import os, sys
from lightning.pytorch import Trainer
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule

TRAINER_PID = os.getpid()

def my_reward(prompts, completions, **kwargs):
    # 1.0 where it runs in another process than the trainer's: the worker under the time limit.
    return [float(os.getpid() != TRAINER_PID)] * len(completions)

module = ExGRPOModule(
    model_name_or_path=sys.argv[1], reward_funcs=[my_reward], num_generations=2, max_completion_length=3
)
data = PromptDataModule(synthetic=ArithmeticTask(num_questions=16), batch_size=4, val_fraction=0.0)
trainer = Trainer(
    max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
    enable_model_summary=False, limit_val_batches=0, default_root_dir=sys.argv[2],
)
trainer.fit(module, datamodule=data)
print("REWARD", module.last_step_metrics["train/rewards/my_reward/mean"])
"""


@pytest.mark.slow  # a fresh interpreter imports torch, Lightning and transformers: 15-40 s on 2 cores
def test_a_reward_defined_in_the_users_script_trains_under_the_time_limit(tiny_model_dir, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), tiny_model_dir, str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(REPO), "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REWARD 1.0" in done.stdout  # scored in the worker process, not the trainer's


def test_a_reward_that_cannot_reach_the_worker_stops_the_run_before_the_model_loads(tiny_model_dir, tmp_path):
    lock = threading.Lock()

    def locked(prompts, completions, **columns):
        with lock:
            return [1.0] * len(completions)

    module = tiny_module(tiny_model_dir, reward_funcs=[locked], reward_timeout_seconds=30)
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=16), batch_size=4, val_fraction=0.0)
    trainer = Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(RewardNotSendableError, match=r"'locked' cannot run in a worker process.*lock"):
        trainer.fit(module, datamodule=data)
    assert module.policy is None  # found at setup: the model was never loaded

"""examples/manual_loop.py runs the seed's loop for real: it fills the buffer, then replays from it."""

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "manual_loop.py"
TINY = ["--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "8", "--min-buffer-size", "8"]
TINY += ["--replay-start-epoch", "1"]


@pytest.fixture(scope="module")
def manual_loop():
    spec = importlib.util.spec_from_file_location("manual_loop_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run(manual_loop):
    threads = torch.get_num_threads()  # main() sets the thread count; leave the test process as it was
    yield lambda *extra: manual_loop.main([*TINY, *extra])
    torch.set_num_threads(threads)


def test_replays_after_the_start_epoch(run, capsys):
    summary = run("--replay-probability", "1.0")
    assert len(summary["epoch_rewards"]) == len(summary["val_pass_at_1"]) == 2
    assert all(0.0 <= v <= 1.0 for v in summary["val_pass_at_1"])
    # Epoch 0 is on-policy only and fills the buffer: 3 steps x 8 prompts x 4 rollouts, less retired ones.
    assert summary["replay_steps_per_epoch"][0] == 0
    assert 8 < summary["buffer_size"] <= 96
    # Epoch 1 always flips heads and 24 questions gave the buffer some of medium difficulty (2 of 4 correct),
    # so every step replays; replay steps generate nothing, so epoch 1 has no fresh reward.
    assert summary["replay_steps_per_epoch"][1] == 3
    assert summary["replay_steps"] == 3
    assert summary["epoch_rewards"][1] != summary["epoch_rewards"][1]  # nan
    out = capsys.readouterr().out
    assert "epoch 1" in out and "replay steps  3/3" in out and "last replayed trajectory" in out


def test_no_replay_when_the_coin_never_says_yes(run):
    summary = run("--replay-probability", "0.0")
    assert summary["replay_steps"] == 0
    assert summary["buffer_size"] > 96  # both epochs stored fresh rollouts

"""examples/own_module_inline.py: a GRPO module whose sampling was inline in training_step
(examples/grpo_inline.py), made replay-ready. It trains ExGRPO in both modes, trains exactly as the plain
module without the callback, and its diff against the plain module is the count the docs give."""

import difflib
import importlib.util
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.rewards import FormatReward

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# `diff examples/grpo_inline.py examples/own_module_inline.py`: lines removed ("<") and added (">").
REMOVED, ADDED = 17, 22


def load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plain, inline = load("grpo_inline"), load("own_module_inline")


def tiny(module_class, model_dir):
    """The example's module on the tiny test model, with a format reward that varies across its samples."""
    module = module_class(model=model_dir, max_new_tokens=4, learning_rate=1e-3)
    module.reward_fn = FormatReward(r"[0-9].*")
    return module


class RecordRollouts(Callback):
    def __init__(self):
        self.rollouts = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts.append(outputs["rollouts"])


def fit(tmp_path, module, callbacks, max_steps=3):
    seed_everything(0)
    trainer = Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
        default_root_dir=tmp_path, callbacks=callbacks,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(module, datamodule=data)
    return trainer


def test_the_diff_against_the_plain_module_is_the_documented_count():
    before = (EXAMPLES / "grpo_inline.py").read_text().splitlines()
    after = (EXAMPLES / "own_module_inline.py").read_text().splitlines()
    lines = [
        line
        for line in difflib.unified_diff(before, after, n=0, lineterm="")
        if line[:3] not in ("---", "+++")
    ]
    removed = sum(line.startswith("-") for line in lines)
    added = sum(line.startswith("+") for line in lines)
    assert (removed, added) == (REMOVED, ADDED), "the docs give this count: update it there too"


@pytest.mark.parametrize("mode", ["mix", "swap"])
def test_trains_exgrpo_on_replayed_rows(tmp_path, tiny_model_dir, mode):
    module, record = tiny(inline.GRPO, tiny_model_dir), RecordRollouts()
    callback = ReplayCallback(
        mode=mode, min_buffer_size=1, replay=SelectiveReplay(strategy="uniform", replay_probability=1.0)
    )
    trainer = fit(tmp_path, module, [callback, record])
    # ReplayCallback's checks passed on every step: experience used and flagged, replay_loss called, the fresh
    # rows' behaviour log-probs recorded; the first step filled the buffer, the other two replayed.
    assert callback.replayed_steps == 2 and all(r.replayed.any() for r in record.rollouts[1:])
    if mode == "mix":  # 2 of 4 questions replayed: a stored row first in each of the last two groups
        assert all(r.replayed.view(4, 4).sum(1).tolist() == [0, 0, 1, 1] for r in record.rollouts[1:])
    assert "train/is_weight" in trainer.callback_metrics


def test_without_the_callback_it_trains_exactly_as_the_plain_module(tmp_path, tiny_model_dir):
    modules, record = [tiny(plain.GRPO, tiny_model_dir), tiny(inline.GRPO, tiny_model_dir)], RecordRollouts()
    fit(tmp_path, modules[0], [])
    fit(tmp_path, modules[1], [record])
    assert any(bool(r.advantages.abs().sum() > 0) for r in record.rollouts)  # the policy gradient is not 0
    for a, b in zip(modules[0].model.parameters(), modules[1].model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("example", [plain, inline])
def test_runs_as_a_script_on_the_embedded_policy(example):
    threads = torch.get_num_threads()
    trainer = example.main(["--max-steps", "2", "--batch-size", "4"])
    torch.set_num_threads(threads)
    assert trainer.global_step == 2

"""examples/own_module_kl.py: a GRPO module with automatic optimisation, inline `num_return_sequences`
sampling, its own advantages, a sampling temperature set in `__init__` and a KL term (examples/grpo_kl.py),
made replay-ready. It trains ExGRPO in both modes on correct stored rows only, trains exactly as the plain
module without the callback, resumes exactly, and each adoption mistake is stopped by name."""

import csv
import difflib
import importlib.util
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.contract import ContractError
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.rewards import FormatReward

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# `diff examples/grpo_kl.py examples/own_module_kl.py`: lines removed ("<") and added (">").
REMOVED, ADDED = 14, 25


def load(name):
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plain, ready = load("grpo_kl"), load("own_module_kl")


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


def fit(tmp_path, module, callbacks, max_steps=3, batch_size=4, ckpt_path=None, **trainer_kwargs):
    seed_everything(0)
    settings = dict(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
        default_root_dir=tmp_path, callbacks=callbacks,
    )  # fmt: skip
    trainer = Trainer(**{**settings, **trainer_kwargs})
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=batch_size)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def replay(mode, probability=1.0):
    """A callback that replays from the first stored row on, with the paper's selection (rescoring)."""
    strategy = SelectiveReplay("gaussian_lowest_entropy", replay_probability=probability)
    return ReplayCallback(mode=mode, min_buffer_size=1, replay=strategy)


def test_the_diff_against_the_plain_module_is_the_documented_count():
    before = (EXAMPLES / "grpo_kl.py").read_text().splitlines()
    after = (EXAMPLES / "own_module_kl.py").read_text().splitlines()
    lines = [
        line
        for line in difflib.unified_diff(before, after, n=0, lineterm="")
        if line[:3] not in ("---", "+++")
    ]
    removed = sum(line.startswith("-") for line in lines)
    added = sum(line.startswith("+") for line in lines)
    assert (removed, added) == (REMOVED, ADDED), "the docs give this count: update it there too"
    assert added <= 30  # the adoption target


def test_without_the_callback_it_trains_exactly_as_the_plain_module(tmp_path, tiny_model_dir):
    """Its own advantages (eps 1e-8, through compute_advantages) and its temperature: bitwise its own."""
    modules, record = [tiny(plain.GRPO, tiny_model_dir), tiny(ready.GRPO, tiny_model_dir)], RecordRollouts()
    fit(tmp_path, modules[0], [])
    fit(tmp_path, modules[1], [record])
    assert any(bool(r.advantages.abs().sum() > 0) for r in record.rollouts)  # the policy gradient is not 0
    for a, b in zip(modules[0].model.parameters(), modules[1].model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["mix", "swap"])
def test_trains_exgrpo_on_correct_stored_rows_in_both_modes(tmp_path, tiny_model_dir, mode):
    module, record = tiny(ready.GRPO, tiny_model_dir), RecordRollouts()
    callback = replay(mode, 1.0 if mode == "mix" else 0.99)
    trainer = fit(tmp_path, module, [callback, record], max_steps=4)
    replayed = [r for r in record.rollouts if r.replayed.any()]
    assert callback.replayed_steps >= 1 and len(replayed) == callback.replayed_steps
    assert all(bool(r.correct[r.replayed].all()) for r in replayed)  # the paper's unit: correct solutions
    if mode == "swap":  # fewer rows than B x K, in groups of 1: the module's reshapes follow group_size
        assert all(r.group_size == 1 and len(r) <= 16 for r in replayed)
    assert "train/is_weight" in trainer.callback_metrics


def test_rescoring_uses_the_modules_own_temperature(tmp_path, tiny_model_dir):
    """`self.temperature = 0.9` (no hparams): stored entropy (the module's forward at 0.9) and the
    library's rescoring agree."""
    module, record = tiny(ready.GRPO, tiny_model_dir), RecordRollouts()
    fit(tmp_path, module, [record], max_steps=1)
    untrained = tiny(ready.GRPO, tiny_model_dir)  # the policy that sampled and scored the recorded rows
    assert untrained.sampling_temperature() == 0.9
    with torch.no_grad():
        rescored = untrained.score_entropy(record.rollouts[0])
    torch.testing.assert_close(rescored, record.rollouts[0].entropy, atol=1e-5, rtol=1e-5)


class Detached(ready.GRPO):
    def replay_loss(self, per_token, logps, rollouts, rows=slice(None)):
        return super().replay_loss(per_token, logps.detach(), rollouts, rows)


def test_detached_log_probs_into_replay_loss_are_stopped(tmp_path, tiny_model_dir):
    with pytest.raises(ContractError, match="log-probs without gradient for .* replayed rows"):
        fit(tmp_path, tiny(Detached, tiny_model_dir), [replay("mix")])


class Renamed(ready.GRPO):
    """Keeps its policy under a name `replay_policy` does not look for."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = self.model
        del self.model

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net.parameters(), lr=self.learning_rate)


def test_a_module_without_its_policy_or_temperature_stops_before_the_first_step(tmp_path, tiny_model_dir):
    module = tiny(ready.GRPO, tiny_model_dir)
    del module.temperature
    with pytest.raises(ContractError, match=r"set `self.temperature = <the temperature your sampler uses>`"):
        fit(tmp_path, module, [replay("mix")])
    module = tiny(Renamed, tiny_model_dir)
    with pytest.raises(ContractError, match=r"override ReplayMixin.replay_policy\(\).*rescores stored"):
        fit(tmp_path, module, [replay("mix")])


def test_mix_mode_with_a_batch_of_one_is_stopped(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="mode='mix' with training batches of 1 question"):
        fit(tmp_path, tiny(ready.GRPO, tiny_model_dir), [replay("mix")], batch_size=1)


def test_swap_on_every_step_still_generates_after_four_replay_steps(tmp_path, tiny_model_dir):
    """Swap with replay_probability 1 no longer trains on stored rows alone from the first replay on: the
    default max_consecutive_replay_steps=4 makes every fifth step sample, score and store new rollouts."""
    record, callback = RecordRollouts(), replay("swap")
    fit(tmp_path, tiny(ready.GRPO, tiny_model_dir), [callback, record], max_steps=6)
    assert [bool(r.replayed.any()) for r in record.rollouts] == [False, True, True, True, True, False]
    assert len(record.rollouts[-1]) == 16 and callback.forced_fresh_steps == 1


class ReshapesByK(ready.GRPO):
    """Reshapes a step's rows by K, as examples/grpo_kl.py's loss does (`per_row.view(-1, k)`)."""

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        out["rollouts"].rewards.view(-1, self.num_generations)  # [B, K]: not a swap step's stored rows
        return out


class RecordExperience(Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rows.append(len(batch["experience"].rollouts) if "experience" in batch else None)


def test_a_reshape_by_k_in_a_short_swap_step_names_the_cause_and_the_fix(tmp_path, tiny_model_dir):
    record = RecordExperience()
    with pytest.raises(RuntimeError, match=r"shape '\[-1, 4\]' is invalid for input of size") as caught:
        fit(tmp_path, tiny(ReshapesByK, tiny_model_dir), [replay("swap"), record], max_steps=3)
    rows = record.rows[-1]
    assert record.rows[0] is None and rows % 4  # a fresh step passed; the swap step's rows do not fit K
    (note,) = caught.value.__notes__
    assert f"this step was a swap replay step, which hands training_step only the {rows} stored rows" in note
    assert "not batch_size x num_generations = 16 rows in groups of K" in note
    assert "reshape by k = rollouts.group_size instead" in note and "docs/replay_contract.md" in note


class FailsOnItsFirstStep(ready.GRPO):
    def training_step(self, batch, batch_idx):
        torch.zeros(6).view(-1, 4)


def test_a_shape_error_outside_a_swap_step_is_left_as_torch_raised_it(tmp_path, tiny_model_dir):
    with pytest.raises(RuntimeError, match="is invalid for input of size 6") as caught:
        fit(tmp_path, tiny(FailsOnItsFirstStep, tiny_model_dir), [replay("swap")], max_steps=1)
    assert not getattr(caught.value, "__notes__", None)


def test_resume_continues_the_global_rng_the_module_samples_from(tmp_path, tiny_model_dir):
    """2 steps + resume + 2 steps equals 4 steps, bitwise: the callback's state carries the global RNG
    states that `generate(do_sample=True)` draws from."""
    whole = tiny(ready.GRPO, tiny_model_dir)
    fit(tmp_path / "whole", whole, [replay("mix", 0.5)], max_steps=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = tiny(ready.GRPO, tiny_model_dir)
    fit(tmp_path / "a", first, [replay("mix", 0.5), checkpoint], max_steps=2,
        enable_checkpointing=True)  # fmt: skip
    torch.manual_seed(123)  # whatever ran in between
    resumed = tiny(ready.GRPO, tiny_model_dir)
    ckpt = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    fit(tmp_path / "b", resumed, [replay("mix", 0.5)], max_steps=4, ckpt_path=ckpt)
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_resume_from_an_epochs_end_continues_bitwise(tmp_path, tiny_model_dir):
    """Stopped by max_steps at an epoch's last batch (Lightning's progress of such a checkpoint resumes one
    batch off, which ExGRPOModule corrects for itself): the callback corrects it for a module of one's own."""
    epoch = dict(limit_train_batches=2, max_epochs=10)
    whole = tiny(ready.GRPO, tiny_model_dir)
    fit(tmp_path / "whole", whole, [replay("mix", 0.5)], max_steps=4, **epoch)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = tiny(ready.GRPO, tiny_model_dir)
    fit(tmp_path / "a", first, [replay("mix", 0.5), checkpoint], max_steps=2, enable_checkpointing=True,
        **epoch)  # fmt: skip
    resumed, callback = tiny(ready.GRPO, tiny_model_dir), replay("mix", 0.5)
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")
    trainer = fit(tmp_path / "b", resumed, [callback], max_steps=4, ckpt_path=ckpt, **epoch)
    assert (trainer.global_step, trainer.current_epoch) == (4, 2)
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [[], ["--mode", "mix"], ["--mode", "swap"]])
def test_runs_as_a_script_on_the_embedded_policy(argv):
    threads = torch.get_num_threads()
    trainer = (ready if argv else plain).main(["--max-steps", "2", "--batch-size", "4", *argv])
    torch.set_num_threads(threads)
    assert trainer.global_step == 2


def test_gradient_accumulation_replays_per_batch_and_logs_with_the_module(tmp_path, tiny_model_dir):
    """Under accumulate_grad_batches=2 each training batch takes its own replay decision and buffer update,
    policy versions count optimizer steps, and the replay metrics reach the logger at the steps the module's
    own metrics do."""
    module, record, callback = tiny(ready.GRPO, tiny_model_dir), RecordRollouts(), replay("mix", 0.5)
    logger = CSVLogger(tmp_path, name="log")
    fit(tmp_path, module, [callback, record], max_steps=3, accumulate_grad_batches=2, logger=logger,
        log_every_n_steps=1)  # fmt: skip
    assert len(record.rollouts) == 6  # 3 optimizer steps x 2 batches
    assert callback.replayed_steps + callback.fallback_steps <= 6 and callback.replayed_steps >= 1
    versions = [int(r.policy_version[~r.replayed].max()) for r in record.rollouts]
    assert versions == [0, 0, 1, 1, 2, 2]
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = list(csv.DictReader(f))
    module_steps = {row["step"] for row in logged if row.get("reward")}
    replay_steps = {row["step"] for row in logged if row.get("replay/buffer_size")}
    assert module_steps and module_steps == replay_steps

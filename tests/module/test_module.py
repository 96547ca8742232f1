"""ExGRPOModule: config validation, the update math end to end, and real Trainer runs on a tiny model."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from exgrpo_pl.contract import Experience, ReplayableModule
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import FormatReward


def make_module(path, **kwargs):
    module = tiny_module(path, **kwargs)
    module.configure_model()
    return module


def make_data(**kwargs):
    return PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4, **kwargs)


def tiny_trainer(tmp_path, **kwargs):
    defaults = dict(
        max_steps=3,
        accelerator="cpu",
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        num_sanity_val_steps=0,
    )
    return Trainer(default_root_dir=tmp_path, **{**defaults, **kwargs})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 1}, "num_generations=1: must be >= 2"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"max_completion_length": -1}, "max_completion_length=-1"),
        ({"loss_type": "ppo"}, "allowed: grpo, dr_grpo, dapo"),
        ({"scale_rewards": "median"}, "allowed: group, batch, none"),
        ({"off_policy_correction": "clip"}, "allowed: shaping, truncate, none"),
        ({"importance_sampling_level": "word"}, "importance_sampling_level='word'.*allowed: token, sequence"),
        ({"delta": 1.0}, "delta=1.0: must be > 1"),
        ({"top_p": 0.0}, "top_p=0.0"),
    ],
)
def test_bad_settings_are_rejected_at_construction(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExGRPOModule(model_name_or_path=tiny_model_dir, **kwargs)


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo"])
def test_sequence_level_ratio_with_a_token_sum_loss_warns(tiny_model_dir, loss_type):
    with pytest.warns(
        UserWarning, match=f"importance_sampling_level='sequence' with loss_type='{loss_type}'"
    ):
        ExGRPOModule(
            model_name_or_path=tiny_model_dir, loss_type=loss_type, importance_sampling_level="sequence"
        )


def test_module_follows_the_replay_contract(tiny_model_dir):
    assert isinstance(make_module(tiny_model_dir), ReplayableModule)


def test_long_prompt_is_an_error_naming_the_question_unless_truncation(tiny_model_dir):
    module = make_module(tiny_model_dir, max_prompt_length=3)
    with pytest.raises(ValueError, match="question_id=7 has 6 tokens > max_prompt_length=3"):
        module.collector.encode(["12+34="], torch.tensor([7]))
    module = make_module(tiny_model_dir, max_prompt_length=3, truncate_prompts=True)
    (row,) = module.collector.encode(["12+34="], torch.tensor([7]))
    assert module.tokenizer.decode(row) == "34="


def test_a_long_prompt_anywhere_in_the_data_stops_fit_before_the_first_step(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, max_prompt_length=5)  # "12+34=" is 6 characters, "1+2=" 4
    trainer = tiny_trainer(tmp_path, max_steps=1)
    with pytest.raises(
        ValueError, match=r"synthetic task ArithmeticTask: prompt of question_id=\d+ has 6 tokens"
    ):
        trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 0


def test_a_prompt_and_completion_past_the_models_positions_stop_fit_naming_row_file_and_numbers(
    tiny_model_dir, tmp_path
):
    """The tiny model has 64 positions: a 41-token prompt and 24-token completions would run past them."""
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
    rows.insert(3, {"prompt": "1+" * 20 + "=", "answer": "21"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PromptDataModule(train_path=str(tmp_path / "train.jsonl"), batch_size=4, val_fraction=0)
    module = tiny_module(tiny_model_dir, max_prompt_length=512, max_completion_length=24)
    trainer = tiny_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    expected = (
        r"train\.jsonl: line 4: the prompt of question_id=\S+ has 41 tokens, and with "
        r"max_completion_length=24 its sequences reach 65 tokens, more than the model's "
        r"max_position_embeddings=64"
    )
    with pytest.raises(ValueError, match=expected):
        trainer.fit(module, datamodule=data)
    assert trainer.global_step == 0 and module.policy is None  # before the model is built
    trainer = tiny_trainer(tmp_path, max_steps=1, limit_val_batches=0)
    trainer.fit(tiny_module(tiny_model_dir, max_prompt_length=512, max_completion_length=23), datamodule=data)


def test_text_the_tokenizer_cannot_read_stops_fit_naming_file_row_and_characters(tiny_model_dir, tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "What is 2 + 3?", "answer": "5"}]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), val_path=str(tmp_path / "val.jsonl"))
    trainer = tiny_trainer(tmp_path, max_steps=1)
    expected = (
        r"val\.jsonl: line 2: column 'prompt' of question_id=\d+ holds characters .* cannot encode: ' ', '\?'"
    )
    with pytest.raises(ValueError, match=expected):
        trainer.fit(make_module(tiny_model_dir), datamodule=data)
    assert trainer.global_step == 0


def test_fit_changes_weights_and_logs_trl_metrics(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir)
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = tiny_trainer(tmp_path, val_check_interval=3)
    trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 3
    assert any(not torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))
    logged = trainer.logged_metrics
    for name in [
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "entropy",
        "clip_ratio",
        "grad_norm",
        "learning_rate",
        "num_tokens",
        "step_time",
    ]:
        assert f"train/{name}" in logged, name
    assert {"timing/generation", "timing/forward_backward", "timing/reward"} <= set(logged)
    assert 0.0 <= float(logged["val/pass@1"]) <= 1.0


def test_micro_batching_gives_the_same_update(tiny_model_dir, tmp_path):
    results = []
    for micro in (None, 3):
        seed_everything(0)
        module = make_module(tiny_model_dir, micro_batch_size=micro)
        trainer = tiny_trainer(tmp_path, max_steps=1, limit_val_batches=0)
        trainer.fit(module, datamodule=make_data())
        results.append(
            (trainer.logged_metrics["train/loss"], [p.detach().clone() for p in module.policy.parameters()])
        )
    (loss_a, params_a), (loss_b, params_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params_a, params_b))
    assert any(
        not torch.equal(a, b) for a, b in zip(params_a, make_module(tiny_model_dir).policy.parameters())
    )


class Record(Callback):
    """Keeps every step's training_step output."""

    def __init__(self):
        self.outputs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.outputs.append(outputs)


def test_fresh_rows_get_behaviour_logps_and_entropy_from_the_update(tiny_model_dir, tmp_path):
    record = Record()
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[record])
    trainer.fit(make_module(tiny_model_dir), datamodule=make_data())
    out = record.outputs[0]["rollouts"]
    real = out.completion_mask
    assert torch.all(out.behaviour_logps[real] < 0) and torch.all(out.behaviour_logps[~real] == 0)
    assert torch.all(out.entropy > 0)
    assert record.outputs[0]["skipped"] is False


def test_swap_experience_trains_on_stored_rows_without_generating(tiny_model_dir, tmp_path):
    record = Record()
    data = make_data()
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[record], limit_val_batches=0)
    trainer.fit(make_module(tiny_model_dir), datamodule=data)
    stored = record.outputs[0]["rollouts"].select(list(range(6)))
    stored.replayed[:] = True

    class InjectSwap(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batch["experience"] = Experience("swap", stored)

    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[InjectSwap(), record], limit_val_batches=0)
    trainer.fit(make_module(tiny_model_dir), datamodule=data)
    trained = record.outputs[-1]["rollouts"]
    assert len(trained) == 6 and bool(trained.replayed.all())
    assert trainer.logged_metrics["timing/generation"] == 0.0
    assert "train/is_weight" in trainer.logged_metrics


class WalkOfAStep(Callback):
    """Records (caller file, callee file) of every call between two package files during a training step."""

    PACKAGE = Path(__file__).parents[2]

    def __init__(self):
        self.calls = []

    def _file(self, frame):
        """The frame's file relative to the package's folder (or to callbacks/), or None outside both."""
        path = Path(frame.f_code.co_filename)
        for folder in (self.PACKAGE / "exgrpo_pl", self.PACKAGE / "callbacks"):
            if path.is_relative_to(folder):
                return path.relative_to(folder).as_posix()
        return None

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_back is not None:
            caller, callee = self._file(frame.f_back), self._file(frame)
            if caller and callee and caller != callee:
                self.calls.append((caller, callee))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sys.setprofile(None)


def test_a_training_step_reads_top_to_bottom_and_no_stage_calls_back_up(tiny_model_dir, tmp_path):
    """plan -> collect -> groups -> update, each entered once from the module, none calling an earlier one."""
    record, data = Record(), make_data()
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[record], limit_val_batches=0)
    trainer.fit(make_module(tiny_model_dir), datamodule=data)
    stored = record.outputs[0]["rollouts"].select([0])
    stored.replayed[:] = True

    class InjectMix(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batch["experience"] = Experience("mix", stored)

    walk = WalkOfAStep()
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[InjectMix(), walk, record], limit_val_batches=0)
    trainer.fit(make_module(tiny_model_dir), datamodule=data)
    assert bool(record.outputs[-1]["rollouts"].replayed.any())  # a mixed step, the longest way through
    module = ("module/grpo.py", "module/sampling.py")  # the module's own files: it samples in the second
    from_module = [callee for caller, callee in walk.calls if caller in module and callee not in module]
    visits = [f for i, f in enumerate(from_module) if i == 0 or f != from_module[i - 1]]
    # step/refill.py: which groups are dead (none gives way without refill or dynamic sampling); batch.py:
    # the groups moved to the module's device (`RolloutBatch.to`)
    steps = [
        "step/plan.py",
        "step/collect.py",
        "step/assembly.py",
        "step/refill.py",
        "batch.py",
        "step/update.py",
    ]
    assert visits == steps
    stages = [
        "module/grpo.py",
        "step/plan.py",
        "step/collect.py",
        "step/assembly.py",
        "step/refill.py",
        "step/update.py",
    ]
    back = [
        (a, b) for a, b in walk.calls if a in stages and b in stages and stages.index(b) < stages.index(a)
    ]
    assert back == []


def overflowing_reward(prompts, completions, **columns):
    """Finite rewards whose advantages are so large that the loss overflows float32."""
    return [1e38 * (i % 2) for i in range(len(prompts))]


overflowing_reward.in_process = True  # called here: a worker process would import this test module (seconds)


class PoisonSteps(Callback):
    """Scores the chosen batches with `overflowing_reward`, the others with the tiny module's reward."""

    def __init__(self, batches):
        self.batches = set(batches)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        poisoned = batch_idx in self.batches
        pl_module.collector.reward_funcs = [overflowing_reward if poisoned else FormatReward(r"[0-9].*")]


def test_a_non_finite_update_is_skipped_and_counted_and_the_weights_stay(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, scale_rewards="none")
    record = Record()
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[PoisonSteps({1}), record], log_every_n_steps=1)
    trainer.fit(module, datamodule=make_data())
    assert [o["skipped"] for o in record.outputs] == [False, True, False]  # a skipped batch is no step
    assert module.nonfinite.skipped == 1 and trainer.global_step == 2
    assert float(trainer.logged_metrics["train/nonfinite_steps"]) == 1.0
    assert all(torch.isfinite(p).all() for p in module.policy.parameters())


def test_non_finite_updates_in_a_row_stop_the_run_with_a_clear_error(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir, scale_rewards="none", max_nonfinite_steps=2)
    before = [p.detach().clone() for p in module.policy.parameters()]
    record = Record()
    trainer = tiny_trainer(tmp_path, max_steps=5, callbacks=[PoisonSteps(range(5)), record])
    with pytest.raises(RuntimeError, match="2 updates in a row had a non-finite loss"):
        trainer.fit(module, datamodule=make_data())
    assert [o["skipped"] for o in record.outputs] == [True]
    assert all(torch.equal(a, b) for a, b in zip(before, module.policy.parameters()))


def test_validation_samples_never_change_what_training_samples(tiny_model_dir, tmp_path):
    completions = []
    for val_every in (1, 3):
        seed_everything(0)
        record = Record()
        trainer = tiny_trainer(
            tmp_path, max_steps=3, val_check_interval=val_every, callbacks=[record], limit_val_batches=1
        )
        trainer.fit(make_module(tiny_model_dir), datamodule=make_data())
        completions.append([o["rollouts"].completions for o in record.outputs])
    assert completions[0] == completions[1]


def test_the_rollout_engine_is_chosen_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="rollout_engine='vllm'; allowed: hf"):
        ExGRPOModule(model_name_or_path=tiny_model_dir, rollout_engine="vllm")
    with pytest.raises(ValueError, match="rollout_engine_options=.*bogus"):
        ExGRPOModule(model_name_or_path=tiny_model_dir, rollout_engine_options={"bogus": 1})
    assert type(make_module(tiny_model_dir).engine).__name__ == "HFEngine"


def test_kl_to_a_frozen_reference_only_when_beta_is_positive(tiny_model_dir, tmp_path):
    assert make_module(tiny_model_dir).reference is None
    module = make_module(tiny_model_dir, beta=0.1)
    reference = [p.detach().clone() for p in module.reference.parameters()]
    trainer = tiny_trainer(tmp_path, max_steps=2, limit_val_batches=0)
    trainer.fit(module, datamodule=make_data())
    assert float(trainer.logged_metrics["train/kl"]) > 0  # the policy moved away from the reference
    assert all(torch.equal(a, b) for a, b in zip(reference, module.reference.parameters()))


def test_the_engine_warm_up_leaves_the_global_generator_alone(tiny_model_dir):
    """A resumed run restores the generators before `on_fit_start`: the warm-up must not draw from them."""
    module = tiny_module(tiny_model_dir)
    module.configure_model()
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=40, seed=1), batch_size=4)
    data.setup("fit")
    module._trainer = SimpleNamespace(datamodule=data)
    calls = []
    module.engine.warm_up = lambda shapes: calls.append(torch.rand(3))  # samples, as the static engine does
    before = torch.get_rng_state()
    module.on_fit_start()
    assert calls and torch.equal(torch.get_rng_state(), before)

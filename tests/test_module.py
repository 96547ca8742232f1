"""ExGRPOModule: config validation, the update math end to end, and real Trainer runs on a tiny model."""

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from exgrpo_pl.contract import Experience, ReplayableModule
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule


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
        ({"top_p": 0.0}, "top_p=0.0"),
    ],
)
def test_bad_settings_are_rejected_at_construction(tiny_model_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExGRPOModule(model_name_or_path=tiny_model_dir, **kwargs)


def test_module_follows_the_replay_contract(tiny_model_dir):
    assert isinstance(make_module(tiny_model_dir), ReplayableModule)


def test_long_prompt_is_an_error_naming_the_question_unless_truncation(tiny_model_dir):
    module = make_module(tiny_model_dir, max_prompt_length=3)
    with pytest.raises(ValueError, match="question_id=7 has 6 tokens > max_prompt_length=3"):
        module._encode_prompts(["12+34="], torch.tensor([7]))
    module = make_module(tiny_model_dir, max_prompt_length=3, truncate_prompts=True)
    (row,) = module._encode_prompts(["12+34="], torch.tensor([7]))
    assert module.tokenizer.decode(row) == "34="


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


def test_fresh_rows_get_behaviour_logps_and_entropy_from_the_update(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir)
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(module, datamodule=make_data())
    out = module._collect(next(iter(trainer.datamodule.train_dataloader())), None, {})
    assert torch.all(out.behaviour_logps == 0)  # not yet scored
    module._update(out)
    real = out.completion_mask
    assert torch.all(out.behaviour_logps[real] < 0) and torch.all(out.behaviour_logps[~real] == 0)
    assert torch.all(out.entropy > 0)


def test_mix_experience_makes_groups_of_stored_plus_fresh(tiny_model_dir):
    module = make_module(tiny_model_dir)
    data = make_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    first = module._collect(batch, None, {})
    stored = first.select([0, 4], group_size=1)  # one trajectory each of the first two questions
    stored.replayed[:] = True
    stored.rewards = torch.tensor([1.0, 1.0])
    mixed = module._collect(dict(batch), stored, {})
    k = module.num_generations
    assert len(mixed) == len(batch["prompt"]) * k and mixed.group_size == k
    # The last two groups are the replayed questions: stored row first, then K-1 fresh rows.
    for g, q in zip((2, 3), stored.question_ids.tolist()):
        group = slice(g * k, (g + 1) * k)
        assert mixed.question_ids[group].tolist() == [q] * k
        assert mixed.replayed[group].tolist() == [True] + [False] * (k - 1)
        rewards = mixed.rewards[group]
        assert torch.allclose(mixed.advantages[group].sum(), torch.tensor(0.0), atol=1e-5)
        assert rewards[0] == 1.0


def test_swap_experience_trains_on_stored_rows_without_generating(tiny_model_dir, tmp_path):
    module = make_module(tiny_model_dir)
    data = make_data()
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    stored = module._collect(batch, None, {}).select(list(range(6)))
    stored.replayed[:] = True
    stored.advantages = torch.ones(6)

    class InjectSwap(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batch["experience"] = Experience("swap", stored)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.outputs = outputs

    inject = InjectSwap()
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[inject], limit_val_batches=0)
    trainer.fit(module, datamodule=data)
    trained = inject.outputs["rollouts"]
    assert len(trained) == 6 and bool(trained.replayed.all())
    assert trainer.logged_metrics["timing/generation"] == 0.0
    assert "train/is_weight" in trainer.logged_metrics


def test_kl_to_a_frozen_reference_only_when_beta_is_positive(tiny_model_dir, tmp_path):
    assert make_module(tiny_model_dir).reference is None
    module = make_module(tiny_model_dir, beta=0.1)
    reference = [p.detach().clone() for p in module.reference.parameters()]
    trainer = tiny_trainer(tmp_path, max_steps=2, limit_val_batches=0)
    trainer.fit(module, datamodule=make_data())
    assert float(trainer.logged_metrics["train/kl"]) > 0  # the policy moved away from the reference
    assert all(torch.equal(a, b) for a, b in zip(reference, module.reference.parameters()))

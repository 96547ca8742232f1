"""LoRA through peft: only the adapter trains, and the KL reference is the base model (adapter off)."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.models import load_policy
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import FormatReward
from exgrpo_pl.step.rollout import completion_logps

pytest.importorskip("peft")

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def fit(module, tmp_path, steps=2):
    seed_everything(0)
    trainer = Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4))
    return trainer


def make(model_dir, **kwargs):
    return ExGRPOModule(
        model_name_or_path=model_dir, num_generations=4, max_completion_length=4, learning_rate=1e-2,
        reward_funcs=[FormatReward(r"[0-9].*")], lora=LORA, **kwargs,
    )  # fmt: skip


def test_only_adapter_weights_train(tiny_model_dir, tmp_path):
    module = make(tiny_model_dir)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    fit(module, tmp_path)
    changed = {n for n, p in module.policy.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_reference_is_the_base_model_with_the_adapter_off(tiny_model_dir, tmp_path):
    module = make(tiny_model_dir, beta=0.1)
    trainer = fit(module, tmp_path)
    assert module.reference is None  # no second copy of the model
    assert float(trainer.logged_metrics["train/kl"]) > 0
    base = load_policy(tiny_model_dir)
    ids = torch.tensor([[5, 6, 15], [7, 8, 15]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    completion = torch.tensor([[4, 2], [9, 2]])
    rollouts = SimpleNamespace(
        prompt_ids=ids, prompt_mask=mask, completion_ids=completion,
        completion_mask=torch.ones_like(completion, dtype=torch.bool),
    )  # fmt: skip
    reference = module.reference_logps(rollouts, slice(0, 2))
    expected, _ = completion_logps(base, ids, mask, completion, rollouts.completion_mask)
    assert torch.allclose(reference, expected, atol=1e-5)
    trained, _ = completion_logps(module.policy, ids, mask, completion, rollouts.completion_mask)
    assert not torch.allclose(trained, expected, atol=1e-5)  # the adapter did move the policy


def test_bad_lora_options_fail_at_construction(tiny_model_dir):
    with pytest.raises(ValueError, match="not valid peft.LoraConfig options"):
        ExGRPOModule(model_name_or_path=tiny_model_dir, lora={"rank": 4})

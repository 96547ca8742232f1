"""The rollout memory check: the exact estimate on a small config, and a fit refused before its first step."""

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer
from transformers import LlamaConfig

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.step.rollout_memory import device_memory_bytes, sampling_bytes


def test_the_estimate_is_the_kv_cache_and_the_last_logits():
    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
        vocab_size=10,
    )  # fmt: skip
    # Keys and values: 2 x 2 layers x 2 KV heads x 8 dims x 2 bytes = 128 bytes a token, 3 x 5 tokens;
    # logits: 3 rows x 10 x 4 bytes.
    assert sampling_bytes(config, rows=3, tokens=5, dtype=torch.float16) == 128 * 15 + 3 * 10 * 4


def test_a_config_without_the_fields_is_not_estimated():
    assert sampling_bytes(object(), rows=3, tokens=5, dtype=torch.float32) is None


def test_a_step_that_cannot_fit_is_refused_before_training_naming_the_option(tiny_model_dir, tmp_path):
    huge = 10**9
    module = tiny_module(tiny_model_dir, num_generations=huge)
    trainer = Trainer(
        max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, default_root_dir=tmp_path,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4)
    gib = device_memory_bytes(torch.device("cpu")) / 2**30
    with pytest.raises(
        ValueError, match=rf"num_generations={huge}: .*4,000,000,000 completions.* {gib:.1f} GiB"
    ):
        trainer.fit(module, data)
    assert module.policy is None  # refused before the model was even built

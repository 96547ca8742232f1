"""The rollout memory check: the exact estimate on a small config, and a fit refused before its first step;
the same check of evaluation batches, exact on small cases, and a test refused before the model is built."""

import functools

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer
from transformers import LlamaConfig

from exgrpo_pl.data import ArithmeticTask, EvalSet, PromptDataModule
from exgrpo_pl.step import rollout_memory
from exgrpo_pl.step.rollout_memory import check_evaluation_memory, device_memory_bytes, sampling_bytes


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


@pytest.fixture
def small_config(tmp_path, monkeypatch):
    """Hyperparameters of a model whose completions take 680 bytes each (128 bytes a token x 5 tokens, and
    40 bytes of logits), on a device of 4,080 bytes: 6 completions fit, 7 do not."""
    LlamaConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
        vocab_size=10,
    ).save_pretrained(tmp_path)  # fmt: skip
    monkeypatch.setattr(rollout_memory, "device_memory_bytes", lambda device: 680 * 6)
    return {"model_name_or_path": str(tmp_path), "max_completion_length": 4, "dtype": "float16",
            "val_num_generations": 2}  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "batch_size", "ranks", "refused"),
    [
        ({None: [None] * 3}, 3, 1, None),  # 3 problems x val_num_generations 2: 6 completions
        ({None: [None] * 4}, 4, 1, r"ExGRPOModule val_num_generations=2: a validation batch samples at least"
                                   r" 8 completions at once \(4 problem\(s\) a batch, val_batch_size=4"),
        ({None: [None] * 4}, 4, 2, None),  # each rank's batch holds its 2 problems
        ({None: [None] * 9}, 1, 1, None),
        ({"aime": [32, 4, 1, 1]}, 3, 1, None),  # a batch holds at least the 3 smallest: 1 + 1 + 4
        ({"aime": [4, 2, 2]}, 3, 1, r"eval_sets\['aime'\] num_samples=2-4: a batch of the set .* at least 8"),
        ({"aime": [7]}, 32, 1, r"eval_sets\['aime'\] num_samples=7: .* 7 completions .*Lower the set's"),
    ],
)  # fmt: skip
def test_an_evaluation_batch_is_checked_by_the_fewest_samples_it_can_hold(
    small_config, sets, batch_size, ranks, refused
):
    check = functools.partial(check_evaluation_memory, small_config, sets, batch_size, ranks, "cpu")
    if refused is None:
        check()
    else:
        with pytest.raises(ValueError, match=refused):
            check()


def test_an_evaluation_set_that_cannot_fit_is_refused_before_the_model_is_built(tiny_model_dir, tmp_path):
    sets = {"huge": EvalSet(synthetic=ArithmeticTask(4, seed=3), num_samples=10**9)}
    data = PromptDataModule(
        synthetic=ArithmeticTask(64, seed=1), eval_sets=sets, batch_size=4, val_batch_size=2
    )
    module = tiny_module(tiny_model_dir)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(
        ValueError, match=r"eval_sets\['huge'\] num_samples=1000000000: .* 2,000,000,000 comp"
    ):
        trainer.test(module, datamodule=data)
    assert module.policy is None

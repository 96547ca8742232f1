"""`exgrpo export` / `export_policy`: a checkpoint's policy as a Hugging Face folder that
`AutoModelForCausalLM.from_pretrained` loads to the checkpoint's weights exactly and the same logits."""

import json

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer, seed_everything
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_pl.checkpoints.export import export_policy, main
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.models import load_policy

IDS = torch.tensor([[5, 6, 15, 7], [7, 8, 15, 9]])


def trained_checkpoint(module, path, steps=1):
    """A real Lightning checkpoint of `module` after `steps` training steps."""
    seed_everything(0)
    trainer = Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=path.parent,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4))
    trainer.save_checkpoint(path)
    return path


def assert_same_model(loaded, policy):
    """The same weights, bit for bit, and the same logits."""
    expected = policy.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, policy.eval()(IDS).logits)


def test_a_checkpoint_exports_to_a_folder_that_loads_to_its_weights(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, stop_token_ids=[15], learning_rate=1e-2)
    ckpt = trained_checkpoint(module, tmp_path / "run.ckpt")
    out = export_policy(ckpt, tmp_path / "policy")

    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert_same_model(loaded, module.policy)
    base = load_policy(tiny_model_dir)
    assert not torch.equal(base.lm_head.weight, loaded.lm_head.weight)  # the trained weights, not the base's
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 15]
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("12+3=")["input_ids"] == module.tokenizer("12+3=")["input_ids"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folder left behind


def test_an_existing_folder_is_kept_unless_overwritten(tiny_model_dir, tmp_path):
    ckpt = trained_checkpoint(tiny_module(tiny_model_dir), tmp_path / "run.ckpt")
    out = tmp_path / "policy"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match=f"out={out}: already exists"):
        export_policy(ckpt, out)
    assert (out / "mine.txt").read_text() == "keep"
    export_policy(ckpt, out, overwrite=True)
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "run.ckpt"]


def test_the_embedded_model_exports_with_its_tokenizer(tmp_path):
    module = tiny_module("embedded:tiny-arith", num_generations=2, max_completion_length=2)
    ckpt = trained_checkpoint(module, tmp_path / "run.ckpt")
    main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "policy")])
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "policy"), module.policy)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    assert tokenizer.decode(module.tokenizer("12+3=")["input_ids"]) == "12+3="


def test_a_checkpoint_of_another_module_is_named(tmp_path):
    torch.save({"state_dict": {"layer.weight": torch.ones(2)}, "hyper_parameters": {}}, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match=r"x.ckpt: its hyper_parameters have no model_name_or_path"):
        export_policy(tmp_path / "x.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_a_lora_run_exports_its_adapter_or_the_merged_model(tiny_model_dir, tmp_path, merge):
    pytest.importorskip("peft")
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    module = tiny_module(tiny_model_dir, lora=lora, learning_rate=1e-2)
    ckpt = trained_checkpoint(module, tmp_path / "run.ckpt")
    out = export_policy(ckpt, tmp_path / "policy", merge_lora=merge)

    names = {p.name for p in out.iterdir()}
    assert ({"adapter_config.json", "adapter_model.safetensors"} <= names) != merge
    assert ("model.safetensors" in names) == merge
    loaded = AutoModelForCausalLM.from_pretrained(out)  # transformers loads an adapter onto its base
    with torch.no_grad():
        expected = module.policy.eval()(IDS).logits
        torch.testing.assert_close(loaded.eval()(IDS).logits, expected, rtol=0, atol=1e-5 if merge else 0)
    if not merge:
        from peft import AutoPeftModelForCausalLM

        peft_model = AutoPeftModelForCausalLM.from_pretrained(out)
        assert_same_model(peft_model, module.policy)

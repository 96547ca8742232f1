"""ExportPolicy writes the final policy as a Hugging Face folder when fit ends, from the checkpoint
SafeModelCheckpoint saves then; `exgrpo fit` takes it as a callback and `exgrpo test` takes the folder."""

import json

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer, seed_everything
from transformers import AutoModelForCausalLM

from exgrpo_pl.callbacks import ExportPolicy
from exgrpo_pl.checkpoints import SafeModelCheckpoint
from exgrpo_pl.checkpoints.export import MANIFEST
from exgrpo_pl.cli import main
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule

IDS = torch.tensor([[5, 6, 15, 7]])


def fit(module, tmp_path, callbacks, steps=2):
    seed_everything(0)
    trainer = Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4))
    return trainer


def test_the_final_policy_is_exported_when_fit_ends(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir, learning_rate=1e-2)
    out = tmp_path / "policy"
    out.mkdir()
    (out / "old.txt").write_text("an earlier export")  # replaced: each fit exports its own policy
    (out / MANIFEST).write_text(json.dumps({"files": ["old.txt"]}))
    fit(module, tmp_path, [SafeModelCheckpoint(dirpath=tmp_path / "ckpt"), ExportPolicy(str(out))])
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert not (out / "old.txt").exists()
    for name, tensor in module.policy.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, module.policy.eval()(IDS).logits)


def test_a_folder_of_other_files_stops_the_run_before_training(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir)
    (tmp_path / "notes.txt").write_text("mine")
    callbacks = [SafeModelCheckpoint(dirpath=tmp_path / "ckpt"), ExportPolicy(str(tmp_path))]
    with pytest.raises(FileExistsError, match=r"holds what no export wrote \(notes.txt\)"):
        fit(module, tmp_path, callbacks)
    assert module.policy is None and (tmp_path / "notes.txt").read_text() == "mine"  # before the model


def test_without_a_safe_checkpoint_it_stops_before_training(tiny_model_dir, tmp_path):
    module = tiny_module(tiny_model_dir)
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                      callbacks=[ExportPolicy(str(tmp_path / "policy"))])  # fmt: skip
    with pytest.raises(ValueError, match=r"ExportPolicy\(dirpath=.*the trainer has none: add "):
        trainer.fit(module, PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4))
    assert module.global_step == 0 and not (tmp_path / "policy").exists()


def test_exgrpo_fit_exports_and_exgrpo_test_and_export_read_it(tiny_model_dir, tmp_path, capsys):
    common = [
        "--model.num_generations=2", "--model.max_completion_length=3",
        "--data.synthetic=exgrpo_pl.data.ArithmeticTask", "--data.synthetic.num_questions=40",
        "--data.batch_size=4", "--trainer.accelerator=cpu", "--trainer.limit_test_batches=1",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    policy = tmp_path / "policy"
    main([
        "fit", *common, f"--model.model_name_or_path={tiny_model_dir}", "--trainer.max_steps=1",
        f"--trainer.default_root_dir={tmp_path / 'fit'}", "--model.stop_token_ids=[15]",
        "--trainer.callbacks+=exgrpo_pl.callbacks.ExportPolicy", f"--trainer.callbacks.dirpath={policy}",
    ])  # fmt: skip
    assert f"policy:      {policy}" in capsys.readouterr().out
    main(["test", *common, f"--model.model_name_or_path={policy}", f"--trainer.default_root_dir={tmp_path}"])
    assert "test/pass@1" in capsys.readouterr().out
    assert ExGRPOModule(model_name_or_path=str(policy)).eos_token_ids == [2, 15]  # the run's stop tokens

    (checkpoint,) = (tmp_path / "fit").rglob("epoch=*.ckpt")
    main(["export", "--ckpt_path", str(checkpoint), "--out", str(tmp_path / "again")])
    assert f"to {tmp_path / 'again'}" in capsys.readouterr().out
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "again" / name).read_bytes() == (policy / name).read_bytes(), name

"""`exgrpo export` / `export_policy`: a checkpoint's policy as a Hugging Face folder that
`AutoModelForCausalLM.from_pretrained` loads to the checkpoint's weights exactly and the same logits."""

import json
import multiprocessing
import os
import stat
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from conftest import CPUDeepSpeedStrategy, tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_pl.checkpoints.atomic_writes import OutOfSpaceError
from exgrpo_pl.checkpoints.export import export_policy, main
from exgrpo_pl.checkpoints.saving import COMPLETE_MARKER, SafeModelCheckpoint
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
    with pytest.raises(FileExistsError, match=f"out={out}: already exists"):
        export_policy(ckpt, out)
    export_policy(ckpt, out, overwrite=True)  # an empty folder
    (out / "model.safetensors").write_bytes(b"an earlier export's weights")
    export_policy(ckpt, out, overwrite=True)  # an earlier export
    assert (out / "model.safetensors").read_bytes() != b"an earlier export's weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "run.ckpt"]


def test_overwrite_never_deletes_what_no_export_wrote(tiny_model_dir, tmp_path):
    """A run's folder given as --out with --overwrite: refused, naming what is there, and nothing deleted."""
    run = tmp_path / "lightning_logs" / "version_0"
    ckpt = trained_checkpoint(tiny_module(tiny_model_dir), run / "checkpoints" / "last.ckpt")
    for name in ("hparams.yaml", "events.out.tfevents.1"):
        (run / name).write_text("the run's")
    before = sorted(p for p in run.rglob("*"))
    with pytest.raises(
        FileExistsError, match=r"version_0: holds what no export wrote \(checkpoints/last.ckpt"
    ):
        main(["--ckpt_path", str(ckpt), "--out", str(run), "--overwrite", "true"])
    assert sorted(p for p in run.rglob("*")) == before and ckpt.is_file()
    export = export_policy(ckpt, tmp_path / "policy")
    (export / "notes.txt").write_text("mine")  # a file added to an export is not the export's either
    with pytest.raises(FileExistsError, match=r"policy: holds what no export wrote \(notes.txt\)"):
        export_policy(ckpt, export, overwrite=True)
    assert (export / "notes.txt").read_text() == "mine"


def test_exported_files_get_the_umasks_modes(tiny_model_dir, tmp_path):
    ckpt = trained_checkpoint(tiny_module(tiny_model_dir), tmp_path / "run.ckpt")
    previous = os.umask(0o022)
    try:
        out = export_policy(ckpt, tmp_path / "policy")
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes


def test_a_full_disk_names_the_file_and_keeps_the_earlier_export(tiny_model_dir, tmp_path, monkeypatch):
    ckpt = trained_checkpoint(tiny_module(tiny_model_dir), tmp_path / "run.ckpt")
    out = export_policy(ckpt, tmp_path / "policy")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(tensors, filename, metadata=None):  # safetensors' own error, as a full disk raises it
        Path(filename).write_bytes(b"cut")
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No'
            ' space left on device" })'
        )

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    with pytest.raises(
        OutOfSpaceError, match=r"No space left to write \S*/\.policy\.tmp-\S*/model\.safetensors"
    ):
        export_policy(ckpt, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy", "run.ckpt"]  # no temp folder left


def test_last_exports_the_newest_intact_checkpoint_of_a_run(tiny_model_dir, tmp_path, capsys):
    module = tiny_module(tiny_model_dir)
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    trained_checkpoint(module, checkpoints / "epoch=0-step=1.ckpt")
    newest = trained_checkpoint(module, checkpoints / "epoch=0-step=2.ckpt", steps=2)
    main(["--ckpt_path", "last", "--root", str(tmp_path), "--out", str(tmp_path / "policy")])
    assert f"Exported the policy of {newest}" in capsys.readouterr().out
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "policy"), module.policy)
    with pytest.raises(FileNotFoundError, match=r"ckpt_path=last: no complete, intact checkpoint in"):
        main(["--ckpt_path", "last", "--root", str(tmp_path / "elsewhere"), "--out", str(tmp_path / "x")])


def test_the_embedded_model_exports_with_its_tokenizer(tmp_path):
    module = tiny_module("embedded:tiny-arith", num_generations=2, max_completion_length=2)
    ckpt = trained_checkpoint(module, tmp_path / "run.ckpt")
    main(["--ckpt_path", str(ckpt), "--out", str(tmp_path / "policy")])
    assert_same_model(AutoModelForCausalLM.from_pretrained(tmp_path / "policy"), module.policy)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "policy")
    assert tokenizer.decode(module.tokenizer("12+3=")["input_ids"]) == "12+3="


def test_a_checkpoint_of_another_module_is_named(tmp_path):
    checkpoint = {"state_dict": {"layer.weight": torch.ones(2)}, "hyper_parameters": {}}
    torch.save({**checkpoint, "pytorch-lightning_version": "2.6.6"}, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match=r"x.ckpt: its hyper_parameters have no model_name_or_path"):
        export_policy(tmp_path / "x.ckpt", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_bare_state_dict_or_a_folder_that_is_no_checkpoint_is_named(tmp_path):
    torch.save({"layer.weight": torch.ones(2)}, tmp_path / "weights.pt")
    with pytest.raises(ValueError, match=r"weights.pt: a plain state_dict \(1 tensors"):
        export_policy(tmp_path / "weights.pt", tmp_path / "out")
    folder = tmp_path / "run.ckpt"
    folder.mkdir()
    (folder / COMPLETE_MARKER).write_text("")
    with pytest.raises(ValueError, match=r"run.ckpt: a folder without DeepSpeed's 'latest' file"):
        export_policy(folder, tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"ckpt_path=.*missing.ckpt: no such file or folder"):
        export_policy(tmp_path / "missing.ckpt", tmp_path / "out")
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


class RecordPolicy(Callback):
    """Saves the policy's full weights when training ends (gathered from their ZeRO-3 partitions)."""

    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        import deepspeed

        params = list(pl_module.policy.parameters())
        with deepspeed.zero.GatheredParameters(params):  # a no-op below ZeRO-3
            weights = {name: p.detach().clone() for name, p in pl_module.policy.named_parameters()}
        torch.save(weights, self.out)


def _deepspeed_fit(model_dir: str, stage: int, folder: str, weights: str) -> None:
    """In a child process: one ZeRO-`stage` training step on the CPU (gloo), its checkpoint folder saved."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu", strategy=CPUDeepSpeedStrategy(stage=stage), max_steps=1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[RecordPolicy(weights), SafeModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)],
    )  # fmt: skip
    module = tiny_module(model_dir, learning_rate=1e-2)
    trainer.fit(module, PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=2))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_checkpoint_folder_exports_to_its_weights(tiny_model_dir, tmp_path, stage):
    pytest.importorskip("deepspeed")
    weights = tmp_path / "weights.pt"
    # Spawned, not forked (as in tests/step/test_update.py): a fork can inherit a lock another thread holds.
    child = multiprocessing.get_context("spawn").Process(
        target=_deepspeed_fit, args=(tiny_model_dir, stage, str(tmp_path / "ckpt"), str(weights))
    )
    child.start()
    child.join(timeout=600)
    assert child.exitcode == 0
    folder = tmp_path / "ckpt" / "last.ckpt"
    assert folder.is_dir() and (folder / "latest").is_file()  # DeepSpeed's layout, not a file

    out = export_policy(folder, tmp_path / "policy")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    trained = torch.load(weights, weights_only=True)
    for name, tensor in trained.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    base = load_policy(tiny_model_dir)
    assert not torch.equal(base.lm_head.weight, loaded.lm_head.weight)
    base.load_state_dict(trained, strict=False)  # the tied lm_head follows the embedding
    with torch.no_grad():
        assert torch.equal(loaded.eval()(IDS).logits, base.eval()(IDS).logits)

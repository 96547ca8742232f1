"""Tests for model loading: local paths that are not models fail with "not a model", hub ids pass through."""

import shutil
from pathlib import Path

import pytest
import torch

from exgrpo_pl import models
from exgrpo_pl.models import is_local_path, load_policy, load_tokenizer, resolve_model_path

LOADERS = [load_tokenizer, load_policy]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("name", ["{tmp}/absent", "./absent", "../absent", "runs/absent/checkpoint-10"])
def test_missing_local_path_is_not_a_model(loader, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = name.format(tmp=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"does not exist: not a model") as info:
        loader(name)
    assert repr(name) in str(info.value)
    assert f"{Path(name).absolute()} does not exist" in str(info.value)


@pytest.mark.parametrize("loader", LOADERS)
def test_home_relative_path_is_expanded(loader, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match=rf"'~/models/x': {tmp_path}/models/x does not exist: not a model"
    ):
        loader("~/models/x")


@pytest.mark.parametrize("loader", LOADERS)
def test_empty_directory_is_not_a_model(loader, tmp_path):
    with pytest.raises(ValueError, match=r"is a directory without config.json: not a model \(it is empty\)"):
        loader(str(tmp_path))
    with pytest.raises(ValueError, match="model_name_or_path is empty: not a model"):
        loader("")  # not the current directory


@pytest.mark.parametrize("loader", LOADERS)
def test_directory_without_config_names_what_it_holds_and_a_nested_model(loader, tiny_model_dir, tmp_path):
    # A hub cache's repo folder: the model is two levels down, in snapshots/<hash>.
    shutil.copytree(tiny_model_dir, tmp_path / "snapshots" / "abc123")
    (tmp_path / "refs").mkdir()
    with pytest.raises(
        ValueError, match=r"not a model \(it holds refs, snapshots\); .*snapshots/abc123 has one"
    ):
        loader(str(tmp_path))


@pytest.mark.parametrize("loader", LOADERS)
def test_a_file_is_not_a_model(loader, tiny_model_dir):
    with pytest.raises(ValueError, match=r"model.safetensors is a file: not a model"):
        loader(str(Path(tiny_model_dir) / "model.safetensors"))


def test_model_directory_without_tokenizer_names_its_files(tiny_model_dir, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model_dir) / name, tmp_path / name)
    with pytest.raises(
        ValueError, match=r"no tokenizer could be loaded from .* \(it holds config.json, model.safetensors\)"
    ):
        load_tokenizer(str(tmp_path))
    assert load_policy(str(tmp_path)).config.num_hidden_layers == 1  # the model itself is fine


def test_local_model_directories_load(tiny_model_dir, monkeypatch):
    # Absolute, and relative without "./": a relative path that exists is local, not a hub id.
    monkeypatch.chdir(Path(tiny_model_dir).parent)
    for name in (tiny_model_dir, Path(tiny_model_dir).name):
        assert load_tokenizer(name).pad_token == "<pad>"
        assert isinstance(load_policy(name), torch.nn.Module)
    assert load_tokenizer("embedded:tiny-arith").padding_side == "left"


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen2.5-Math-1.5B", "gpt2", "meta-llama/Llama-3.2-1B_x.y"])
def test_hub_ids_go_to_from_pretrained_unchanged(hub_id, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    assert not is_local_path(hub_id)
    assert resolve_model_path(hub_id) == hub_id
    received = []

    def from_pretrained(path, **kwargs):
        received.append(path)
        raise OSError("offline")

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    for loader in LOADERS:
        with pytest.raises(OSError, match="^offline$"):  # transformers' own error, not rewrapped
            loader(hub_id)
    assert received == [hub_id, hub_id]


@pytest.mark.parametrize(
    ("name", "local"),
    [
        ("/abs/x", True),
        ("./x", True),
        ("../x", True),
        ("~/x", True),
        ("a/b/c", True),
        ("C:\\models\\x", True),
        ("", True),
        ("org/model", False),
        ("model-v1.5", False),
    ],
)
def test_what_counts_as_a_local_path(name, local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_local_path(name) is local
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    assert is_local_path("org/model")  # exists on disk: local, as transformers would take it too


def test_a_lora_adapter_folder_says_how_to_get_a_whole_model(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    expected = r"not a model \(it holds adapter_config.json\); it is a LoRA adapter: export the run with"
    with pytest.raises(ValueError, match=expected):
        resolve_model_path(str(tmp_path))

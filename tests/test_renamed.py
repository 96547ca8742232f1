"""Renamed configs (exgrpo_pl.renamed): which arguments are rewritten, with one warning each, and which are
left as they are. tests/test_cli.py runs the old name through the CLI."""

import sys

import pytest

from exgrpo_pl import moved
from exgrpo_pl.moved import REMOVED_IN
from exgrpo_pl.renamed import (
    RENAMED,
    RenamedConfigError,
    RenamedConfigWarning,
    renamed_config_args,
    with_renamed_configs,
)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "exgrpo_swap.yaml").write_text("seed_everything: 0\n")
    return tmp_path


def test_the_swap_preset_is_the_one_renamed_config():
    assert RENAMED == {"exgrpo_seed.yaml": "exgrpo_swap.yaml"}


@pytest.mark.parametrize("flag", ["--config", "-c"])
@pytest.mark.parametrize("joined", [False, True])
def test_an_old_config_path_becomes_the_new_one_with_one_warning(folder, flag, joined):
    old, new = str(folder / "exgrpo_seed.yaml"), str(folder / "exgrpo_swap.yaml")
    args = ["fit", f"{flag}={old}"] if joined else ["fit", flag, old]
    with pytest.warns(RenamedConfigWarning) as record:
        renamed = renamed_config_args([*args, "--trainer.max_steps=1"])
    assert renamed == (["fit", f"{flag}={new}"] if joined else ["fit", flag, new]) + ["--trainer.max_steps=1"]
    assert [str(w.message) for w in record] == [
        f"{old} was renamed {new} (the old name is read from the new file and is removed in exgrpo-pl "
        f"{REMOVED_IN})"
    ]


def test_an_existing_file_is_read_as_it_is_whatever_its_name(folder, recwarn):
    (folder / "exgrpo_seed.yaml").write_text("seed_everything: 1\n")
    args = ["--config", str(folder / "exgrpo_seed.yaml")]
    assert renamed_config_args(args) == args
    assert not [w for w in recwarn if issubclass(w.category, RenamedConfigWarning)]


def test_an_old_name_without_the_new_file_beside_it_is_left_to_the_parser(tmp_path, recwarn):
    args = ["--config", str(tmp_path / "exgrpo_seed.yaml")]  # jsonargparse says the file does not exist
    assert renamed_config_args(args) == args
    assert not [w for w in recwarn if issubclass(w.category, RenamedConfigWarning)]


def test_only_a_config_flags_value_is_renamed(folder, recwarn):
    old = str(folder / "exgrpo_seed.yaml")
    args = [old, f"--trainer={old}", "--data.train_path", old]
    assert renamed_config_args(args) == args
    assert not [w for w in recwarn if issubclass(w.category, RenamedConfigWarning)]


def test_after_the_removal_an_old_path_is_an_error_naming_the_new_file(folder, monkeypatch):
    monkeypatch.setattr(moved, "VERSION", REMOVED_IN)
    with pytest.raises(RenamedConfigError) as raised:
        renamed_config_args(["--config", str(folder / "exgrpo_seed.yaml")])
    assert str(raised.value) == (
        f"{folder / 'exgrpo_seed.yaml'} was renamed {folder / 'exgrpo_swap.yaml'} "
        f"(the old name was removed in exgrpo-pl {REMOVED_IN})"
    )


def test_the_command_line_is_rewritten_in_place_for_the_ranks_a_launcher_starts(folder, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["exgrpo", "fit", "--config", str(folder / "exgrpo_seed.yaml")])
    with pytest.warns(RenamedConfigWarning):
        assert with_renamed_configs(None) is None
    assert sys.argv == ["exgrpo", "fit", "--config", str(folder / "exgrpo_swap.yaml")]
    assert with_renamed_configs({"config": "x"}) == {"config": "x"}  # a dict of arguments: as it is

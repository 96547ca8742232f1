"""Old module paths (the flat layout before the folders) fail with an error that names the new module, in
Python imports; `tests/test_cli.py` checks the same in config files."""

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import exgrpo_pl
from exgrpo_pl.moved import MOVED, SHORTER, ModuleMovedError, OldPathFinder, old_paths_in

PACKAGE = Path(exgrpo_pl.__file__).parent


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_names_the_new_one(old):
    with pytest.raises(ModuleMovedError, match=rf"^{old} moved to {MOVED[old]}\b") as raised:
        importlib.import_module(old)
    assert isinstance(raised.value, ModuleNotFoundError) and raised.value.new == MOVED[old]


def test_the_public_classes_name_their_short_path():
    with pytest.raises(ModuleNotFoundError) as raised:
        from exgrpo_pl.buffer import TrajectoryBuffer  # noqa: F401
    assert str(raised.value) == (
        "exgrpo_pl.buffer moved to exgrpo_pl.experience.buffer; "
        "TrajectoryBuffer imports from exgrpo_pl.experience"
    )
    with pytest.raises(ModuleNotFoundError, match="SafeModelCheckpoint import from exgrpo_pl.checkpoints$"):
        import exgrpo_pl.checkpointing  # noqa: F401


def test_importing_an_old_module_from_the_package_names_the_new_one():
    """`from exgrpo_pl import buffer` swallows a missing submodule whose error carries its name."""
    with pytest.raises(ModuleMovedError, match="^exgrpo_pl.replay moved to exgrpo_pl.experience.replay;"):
        from exgrpo_pl import replay  # noqa: F401


def test_a_fresh_interpreter_names_the_new_module():
    done = subprocess.run(
        [sys.executable, "-c", "import exgrpo_pl.strategies"], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "exgrpo_pl.moved.ModuleMovedError: exgrpo_pl.strategies moved to exgrpo_pl.module.strategies"
    )


def test_an_older_copy_of_an_old_module_is_not_imported(tmp_path, monkeypatch):
    """An editable install of an older checkout maps `exgrpo_pl.<name>` to its file from a finder after the
    path's: the old module's name still raises, before that finder is asked."""
    (tmp_path / "losses.py").write_text("STALE = True\n")

    class OlderCheckout:
        def find_spec(self, fullname, path=None, target=None):
            if fullname.startswith("exgrpo_pl."):
                file = tmp_path / (fullname.rpartition(".")[2] + ".py")
                return importlib.util.spec_from_file_location(fullname, file) if file.exists() else None
            return None

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, OlderCheckout()])
    with pytest.raises(ModuleMovedError, match="^exgrpo_pl.losses moved to exgrpo_pl.step.losses"):
        importlib.import_module("exgrpo_pl.losses")
    assert "exgrpo_pl.losses" not in sys.modules


def test_the_finder_is_installed_once_and_finds_nothing_else():
    assert sum(isinstance(finder, OldPathFinder) for finder in sys.meta_path) == 1
    importlib.reload(exgrpo_pl)
    assert sum(isinstance(finder, OldPathFinder) for finder in sys.meta_path) == 1
    assert OldPathFinder().find_spec("exgrpo_pl.experience.buffer") is None
    assert importlib.util.find_spec("exgrpo_pl.no_such_module") is None


def test_the_table_names_gone_files_and_existing_modules():
    for old, new in MOVED.items():
        assert not (PACKAGE / f"{old.split('.')[1]}.py").exists(), old
        assert importlib.util.find_spec(new) is not None, new
    assert set(SHORTER) <= set(MOVED)
    short_paths = {
        "exgrpo_pl.experience": ["TrajectoryBuffer", "DifficultyBucketer", "SelectiveReplay"],
        "exgrpo_pl.checkpoints": ["AtomicCheckpointIO", "SafeModelCheckpoint"],
        "exgrpo_pl.module": ["ExGRPOModule", "ReplayMixin"],
    }
    for short, names in short_paths.items():
        assert all(hasattr(importlib.import_module(short), name) for name in names)
    generation = importlib.import_module("exgrpo_pl.engines.generation")
    for name in ("sample_completions", "plain_generation_config", "position_ids_from_mask"):
        assert name in SHORTER["exgrpo_pl.rollout"] and hasattr(generation, name)


def test_old_paths_in_text():
    text = "class_path: exgrpo_pl.buffer.TrajectoryBuffer, exgrpo_pl.experience.buffer, exgrpo_pl.module.grpo"
    assert old_paths_in(text) == [("exgrpo_pl.buffer.TrajectoryBuffer", "exgrpo_pl.buffer")]
    assert old_paths_in("exgrpo_pl.buffer_storage.SlotStorage, my.exgrpo_pl.losses") == [
        ("exgrpo_pl.buffer_storage.SlotStorage", "exgrpo_pl.buffer_storage")
    ]

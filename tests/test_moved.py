"""Old module paths (the flat layout before the folders) work, with a `MovedModuleWarning` that names the new
module and the version that removes them, and fail with an error that names it from that version on;
`tests/test_cli.py` checks the same in config files."""

import importlib
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import exgrpo_pl
from exgrpo_pl import moved
from exgrpo_pl.moved import (
    ELSEWHERE,
    MOVED,
    REMOVED_IN,
    SHORTER,
    ModuleMovedError,
    MovedModuleWarning,
    OldPathFinder,
    old_paths_in,
)

PACKAGE = Path(exgrpo_pl.__file__).parent


@pytest.fixture
def not_imported(monkeypatch):
    """No old module imported yet in this process, so importing one runs the finder again."""
    for old in MOVED:
        monkeypatch.delitem(sys.modules, old, raising=False)
        monkeypatch.delattr(exgrpo_pl, old.split(".")[1], raising=False)


@pytest.fixture
def after_removal(monkeypatch, not_imported):
    monkeypatch.setattr(moved, "VERSION", REMOVED_IN)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_works_and_warns_naming_the_new_one(old, not_imported):
    with pytest.warns(MovedModuleWarning, match=rf"^{old} moved to {MOVED[old]}\b") as record:
        module = importlib.import_module(old)
    assert issubclass(MovedModuleWarning, FutureWarning)  # shown by default, no filter installed
    assert str(record[0].message).endswith(
        f"(the old path is deprecated and is removed in exgrpo-pl {REMOVED_IN})"
    )
    for source in map(importlib.import_module, [MOVED[old], *ELSEWHERE.get(old, [])]):
        names = moved._public(source)
        assert names and all(getattr(module, name) is getattr(source, name) for name in names), source


def test_every_name_of_the_flat_layout_imports_from_its_old_path(not_imported):
    """What adopted code imported before the move (the old modules' public names, from the docs and the
    examples of that time), each from its old path."""
    with pytest.warns(MovedModuleWarning):
        from exgrpo_pl.buffer import TrajectoryBuffer
        from exgrpo_pl.checkpointing import AtomicCheckpointIO, SafeModelCheckpoint  # noqa: F401
        from exgrpo_pl.difficulty import DifficultyBucketer
        from exgrpo_pl.groups import assemble_groups, plan_rollouts  # noqa: F401
        from exgrpo_pl.losses import compute_grpo_loss, group_advantages  # noqa: F401
        from exgrpo_pl.mixin import ReplayMixin  # noqa: F401
        from exgrpo_pl.replay import SelectiveReplay
        from exgrpo_pl.rollout import completion_mask_from_ids, plain_generation_config, sample_completions  # noqa: F401
        from exgrpo_pl.update import PolicyUpdate  # noqa: F401
    from exgrpo_pl.checkpoints import AtomicCheckpointIO as new_io
    from exgrpo_pl.engines.generation import sample_completions as new_sample

    assert (TrajectoryBuffer, DifficultyBucketer, SelectiveReplay) == (
        exgrpo_pl.TrajectoryBuffer, exgrpo_pl.DifficultyBucketer, exgrpo_pl.SelectiveReplay,
    )  # fmt: skip
    assert (
        AtomicCheckpointIO is new_io
        and sample_completions is new_sample
        and compute_grpo_loss is (exgrpo_pl.compute_grpo_loss)
    )
    with pytest.raises(
        AttributeError, match="module 'exgrpo_pl.buffer' .now exgrpo_pl.experience.buffer. has"
    ):
        sys.modules["exgrpo_pl.buffer"].NoSuchName  # noqa: B018


@pytest.mark.parametrize("old", sorted(MOVED))
def test_after_the_removal_an_old_path_is_an_error_naming_the_new_one(old, after_removal):
    with pytest.raises(ModuleMovedError, match=rf"^{old} moved to {MOVED[old]}\b") as raised:
        importlib.import_module(old)
    assert isinstance(raised.value, ModuleNotFoundError) and raised.value.new == MOVED[old]
    assert str(raised.value).endswith(f"(the old path was removed in exgrpo-pl {REMOVED_IN})")


def test_the_public_classes_name_their_short_path(after_removal):
    with pytest.raises(ModuleNotFoundError) as raised:
        from exgrpo_pl.buffer import TrajectoryBuffer  # noqa: F401
    assert str(raised.value) == (
        "exgrpo_pl.buffer moved to exgrpo_pl.experience.buffer; "
        "TrajectoryBuffer imports from exgrpo_pl.experience "
        f"(the old path was removed in exgrpo-pl {REMOVED_IN})"
    )
    with pytest.raises(ModuleNotFoundError, match="SafeModelCheckpoint import from exgrpo_pl.checkpoints "):
        import exgrpo_pl.checkpointing  # noqa: F401


def test_importing_an_old_module_from_the_package_names_the_new_one(after_removal):
    """`from exgrpo_pl import buffer` swallows a missing submodule whose error carries its name."""
    with pytest.raises(ModuleMovedError, match="^exgrpo_pl.replay moved to exgrpo_pl.experience.replay;"):
        from exgrpo_pl import replay  # noqa: F401


@pytest.mark.parametrize(
    "version, is_removed", [("0.1.0", False), ("0.2.9", False), (REMOVED_IN, True), ("0.3.0rc1", True),
                            ("1.0", True)]
)  # fmt: skip
def test_the_old_paths_go_at_the_version_named(monkeypatch, version, is_removed):
    monkeypatch.setattr(moved, "VERSION", version)
    assert moved.removed() is is_removed


def test_a_fresh_interpreter_shows_the_warning_at_the_importing_line():
    """Python hides a DeprecationWarning outside __main__ by default; this one is shown, where it is raised
    for the user: at the line that imports the old path."""
    script = "import exgrpo_pl\nimport exgrpo_pl.strategies as s\nprint(s.check_strategy.__module__)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "exgrpo_pl.module.strategies\n"
    assert done.stderr.splitlines() == [
        "<string>:2: MovedModuleWarning: exgrpo_pl.strategies moved to exgrpo_pl.module.strategies (the old "
        f"path is deprecated and is removed in exgrpo-pl {REMOVED_IN})"
    ]


def test_importing_the_package_leaves_the_users_warning_filters_alone_so_the_warning_can_be_an_error():
    script = (  # torch and numpy add filters of their own at import; this package adds none
        "import warnings\nimport exgrpo_pl\n"
        "assert not any('exgrpo' in f[2].__module__ for f in warnings.filters), warnings.filters\n"
        "import exgrpo_pl.strategies"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", script], capture_output=True, text=True
    )
    assert done.returncode == 1 and done.stderr.splitlines()[-1].startswith(
        "exgrpo_pl.moved.MovedModuleWarning: exgrpo_pl.strategies moved to exgrpo_pl.module.strategies"
    ), done.stderr


def test_an_older_copy_of_an_old_module_is_not_imported(tmp_path, monkeypatch, not_imported):
    """An editable install of an older checkout maps `exgrpo_pl.<name>` to its file from a finder after the
    path's: the old module's name is answered before that finder is asked."""
    (tmp_path / "losses.py").write_text("STALE = True\n")

    class OlderCheckout:
        def find_spec(self, fullname, path=None, target=None):
            if fullname.startswith("exgrpo_pl."):
                file = tmp_path / (fullname.rpartition(".")[2] + ".py")
                return importlib.util.spec_from_file_location(fullname, file) if file.exists() else None
            return None

    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, OlderCheckout()])
    with pytest.warns(MovedModuleWarning, match="^exgrpo_pl.losses moved to exgrpo_pl.step.losses"):
        losses = importlib.import_module("exgrpo_pl.losses")
    assert not hasattr(losses, "STALE") and losses.compute_grpo_loss is exgrpo_pl.compute_grpo_loss
    monkeypatch.setattr(moved, "VERSION", REMOVED_IN)
    monkeypatch.delitem(sys.modules, "exgrpo_pl.losses")
    with pytest.raises(ModuleMovedError, match="^exgrpo_pl.losses moved to exgrpo_pl.step.losses"):
        importlib.import_module("exgrpo_pl.losses")
    assert "exgrpo_pl.losses" not in sys.modules


def test_the_finder_is_installed_once_and_finds_nothing_else():
    assert sum(isinstance(finder, OldPathFinder) for finder in sys.meta_path) == 1
    importlib.reload(exgrpo_pl)
    assert sum(isinstance(finder, OldPathFinder) for finder in sys.meta_path) == 1
    assert OldPathFinder().find_spec("exgrpo_pl.experience.buffer") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing else warns: only the old paths are answered
        assert importlib.import_module("exgrpo_pl.experience.buffer") is not None
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

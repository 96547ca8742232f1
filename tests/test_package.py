"""The package's top level: the seed's objects import from it, and the core pulls in no Lightning."""

import subprocess
import sys


def test_seed_api_imports_from_the_top_level_without_lightning():
    code = (
        "import sys; from exgrpo_pl import TrajectoryBuffer, DifficultyBucketer, SelectiveReplay, "
        "compute_entropy, compute_importance_weights, compute_grpo_loss; "
        "assert not any(m.split('.')[0] == 'lightning' for m in sys.modules), 'core imported lightning'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_seed_defaults_are_the_public_defaults():
    from exgrpo_pl import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer

    buffer = TrajectoryBuffer()
    assert (buffer.max_size, buffer.difficulty_tiers) == (100_000, 5)
    assert buffer.entropy_percentiles == (25, 50, 75)
    bucketer = DifficultyBucketer()
    assert (bucketer.metric, bucketer.window_size) == ("correctness_rate", 100)
    replay = SelectiveReplay()
    assert (replay.strategy, replay.replay_probability, replay.medium_difficulty_range) == (
        "entropy_guided",
        0.3,
        (0.3, 0.7),
    )


def test_every_subpackage_is_listed_for_the_wheel():
    """A subpackage missing from pyproject's explicit list would be absent from a non-editable install."""
    from pathlib import Path

    import tomllib

    root = Path(__file__).parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(root).parts) for init in (root / "exgrpo_pl").rglob("__init__.py")
    }
    assert found | {"exgrpo_pl.callbacks"} == listed


def test_every_module_stays_within_400_lines():
    """Modules are split by responsibility (the buffer into storage, the replay draw and de-duplication; the
    checkpointing, the difficulty bucketer, the groups, the module, ...) to keep each readable in one sitting;
    a file of exgrpo_pl/ or callbacks/ growing past 400 lines is due for the same."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    files = [*(root / "exgrpo_pl").rglob("*.py"), *(root / "callbacks").rglob("*.py")]
    assert len(files) > 40 and root / "exgrpo_pl" / "experience" / "storage.py" in files
    lines = {str(path.relative_to(root)): len(path.read_text().splitlines()) for path in files}
    assert {name: n for name, n in lines.items() if n > 400} == {}

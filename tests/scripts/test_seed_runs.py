"""scripts/seed_runs.py: one commit run twice writes byte-identical files (what a refactor is held to)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "seed_runs.py"


@pytest.mark.slow
def test_the_same_commit_writes_the_same_file_twice(tmp_path):
    spec = importlib.util.spec_from_file_location("seed_runs", SCRIPT)
    seed_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seed_runs)
    for name in ("a.json", "b.json"):
        seed_runs.main([str(tmp_path / name), "--variants", "ExGRPO swap", "--steps", "4"])
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert b'"commit"' not in (tmp_path / "a.json").read_bytes()

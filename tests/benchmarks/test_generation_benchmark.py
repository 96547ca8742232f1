"""benchmarks/generation.py still runs end to end (embedded policy, few tokens, results in tmp_path). Slow."""

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.mark.slow
def test_generation_benchmark(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("generation")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    argv = [
        "--mode",
        "embedded",
        "--rows",
        "4",
        "--new-tokens",
        "6",
        "--rounds",
        "2",
        "--engines",
        "hf",
        "static-eager",
    ]
    monkeypatch.setattr(sys, "argv", ["generation.py", *argv])
    module.main()
    result = json.loads((tmp_path / "generation.json").read_text())["embedded"]
    assert set(result["engines"]) == {"hf", "static-eager"}
    assert result["rows"] == 4 and result["new_tokens"] == 6
    assert result["engines"]["hf"]["ratio_to_hf"] == 1.0
    assert all(len(entry["tokens_per_s"]) == 2 for entry in result["engines"].values())
    assert (tmp_path / "generation.png").exists()

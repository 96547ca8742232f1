"""benchmarks/contract_checks.py still runs end to end (4 steps a mode, results into a temporary folder)."""

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.mark.slow
def test_contract_checks_benchmark(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("contract_checks")
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["contract_checks.py"])
    threads = torch.get_num_threads()  # main() sets the thread count; leave the test process as it was
    module.main(["--steps", "4"])
    torch.set_num_threads(threads)
    result = json.loads((tmp_path / "contract_checks.json").read_text())
    for mode in ("mix", "swap"):
        assert result[mode]["steps"] == 4 and "fresh" in result[mode]["checks_us_first_step_of_each_kind"]
    assert result["large_mixed_batch_1024_rows"]["check_rollouts_us"] > 0

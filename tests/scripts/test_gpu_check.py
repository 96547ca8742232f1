"""scripts/gpu_check.py's plumbing on the CPU (`--device cpu --tiny`): every part it can run there runs,
and its figures reach the one JSON file and the table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_gpu_check_runs_its_cpu_parts_into_one_json(tmp_path):
    out = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["parts"]) == ["plain", "generation", "memory"]
    assert all(part["status"] == "ok" for part in report["parts"].values())
    smoke = report["parts"]["plain"]["figures"]
    assert smoke["steps"] == 2 and {"generation", "reward", "forward_backward"} <= set(smoke["timing_s"])
    engines = report["parts"]["generation"]["figures"]["engines"]
    assert set(engines) == {"hf", "static-eager"} and engines["hf"]["ratio_to_hf"] == 1.0
    steps = report["parts"]["memory"]["figures"]["step"]["after"]
    assert "GRPO" in steps and any(label.startswith("paper preset") for label in steps)
    assert "x GRPO" in result.stdout and "x hf" in result.stdout  # the table


def test_a_missing_gpu_is_said_plainly(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path / "x.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "no CUDA device" in result.stderr

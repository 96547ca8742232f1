"""scripts/gpu_check.py's plumbing on the CPU (`--device cpu --tiny`): every part it can run there runs,
and its figures reach the one JSON file and the table (the `multi` part: tests/scripts/test_gpu_multi.py);
the multi part's table lines, run or skipped."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_gpu_check_runs_its_cpu_parts_into_one_json(tmp_path):
    out = tmp_path / "check.json"
    parts = ["--only", "plain", "generation", "memory"]  # multi: test_gpu_multi.py runs it through here
    result = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--tiny", *parts, "--out", str(out)],
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


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_multi_part_shows_each_check_or_the_skip():
    gpu_check = load_gpu_check()
    run = {
        "ranks": 8,
        "checks": {
            "zero2": {"status": "ok", "relative_error_by_step": [2e-7, 3e-6]},
            "resume": {
                "status": "failed: [0].weights: differs",
                "bitwise": False,
                "stopped_at": 2,
                "steps": 4,
            },
        },
    }
    parts = {
        "multi": {"status": "failed (exit 1)", "seconds": 250.0, "figures": run},
    }
    report = {"environment": {"commit": "abc", "device": "NVIDIA H100"}, "parts": parts}
    lines = gpu_check.table(report).splitlines()
    assert lines[2:] == [
        "    zero2   8 ranks  ok      gradient off by 3.0e-06 of its largest entry",
        "    resume  8 ranks  FAILED  not bitwise after stop at step 2 and resume to 4",
        "      failed: [0].weights: differs",
    ]
    skipped = {
        "multi": {"status": "skipped: 1 GPU(s)", "seconds": 3.0, "figures": {"status": "skipped: 1 GPU(s)"}}
    }
    assert gpu_check.table({**report, "parts": skipped}).splitlines()[1:] == [
        "  multi      skipped: 1 GPU(s)            3.0 s"
    ]

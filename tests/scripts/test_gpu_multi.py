"""scripts/gpu_multi.py, the multi-GPU leg of gpu_check: its comparisons on small exact cases, the skip it
records without several GPUs, and the whole leg through gpu_check on 2 CPU processes (gloo, DeepSpeed's
real engine), the plumbing a GPU machine runs with NCCL."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
SPEC = importlib.util.spec_from_file_location("gpu_multi", ROOT / "scripts" / "gpu_multi.py")
gpu_multi = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_multi)


def test_step_gradients_are_read_back_from_adamws_first_moment():
    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, betas=(0.8, 0.999), weight_decay=0.1)
    grads = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([-3.0, 0.25, 4.0]), torch.tensor([0.0, 1.0, -1.0])]
    moments = []
    for grad in grads:
        weight.grad = grad.clone()
        optimizer.step()
        moments.append(optimizer.state[weight]["exp_avg"].clone())
    for got, expected in zip(gpu_multi.step_gradients(moments, beta1=0.8), grads):
        assert torch.allclose(got, expected, atol=1e-6)


def test_gradients_pass_within_the_tolerance_of_the_largest_entry_and_fail_beyond():
    reference = [torch.tensor([2.0, -1.0, 0.5]), torch.tensor([0.0, 4.0, 1.0])]
    close = [reference[0] + 1e-5, reference[1] - 3e-4]  # 1.5e-4 and 7.5e-5 of the largest entries
    assert gpu_multi.compare_grads(reference, [r.clone() for r in reference])["status"] == "ok"
    result = gpu_multi.compare_grads(reference, close)
    assert result["status"] == "ok"
    assert result["relative_error_by_step"] == pytest.approx([5e-6, 7.5e-5], rel=1e-2)
    off = gpu_multi.compare_grads(reference, [reference[0], reference[1] * 1.001])
    assert off["status"] == "failed: gradient off by 1.00e-03 of its largest entry (> 0.0001)"
    short = gpu_multi.compare_grads(reference, close[:1])
    assert short["status"] == "failed: 1 steps' gradients against the reference's 2"
    zero = [torch.zeros(3)]
    assert gpu_multi.compare_grads(zero, zero)["status"].startswith("failed")  # nothing was trained


def record(weights, rows, replayed):
    return {
        "global_step": 4,
        "weights": weights,
        "buffer": {"question_id": torch.arange(rows), "reward": torch.ones(rows)},
        "generators": {"coin": torch.tensor([1, 2])},
        "replayed_steps": replayed,
        "started_at": 2,
    }


def test_a_resume_passes_bitwise_with_replay_after_it_only():
    weights = torch.tensor([0.5, -0.25])
    straight = [record(weights, 3, 3), record(None, 2, 3)]
    stopped = [record(weights, 2, 1), record(None, 1, 1)]
    result = gpu_multi.compare_resume(straight, stopped, [record(weights.clone(), 3, 3), record(None, 2, 3)])
    assert result["status"] == "ok" and result["bitwise"]
    assert result["replayed_after_resume_by_rank"] == [2, 2]

    moved = gpu_multi.compare_resume(straight, stopped, [record(weights + 1e-7, 3, 3), record(None, 2, 3)])
    assert not moved["bitwise"] and moved["status"].startswith("failed: [0].weights: differs")
    rank1 = [record(weights, 3, 3), record(None, 3, 3)]
    lost = gpu_multi.compare_resume(straight, stopped, rank1)
    assert "[1].buffer.question_id: torch.int64[2] != torch.int64[3]" in lost["status"]
    idle = gpu_multi.compare_resume(straight, [record(weights, 2, 3), record(None, 1, 1)], straight)
    assert idle["bitwise"] and idle["status"] == "failed: a rank replayed nothing after the resume"
    afresh = [{**r, "started_at": 0} for r in straight]  # "last" found nothing: a run from step 0
    restarted = gpu_multi.compare_resume(straight, stopped, afresh)
    assert restarted["bitwise"] and restarted["status"] == "failed: the resumed run started at step 0, not 2"


def test_fewer_than_two_gpus_are_recorded_as_skipped(tmp_path):
    if torch.cuda.device_count() > 1:
        pytest.skip("this machine has several GPUs")
    result = subprocess.run(
        [sys.executable, "scripts/gpu_multi.py", "--workdir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    gpus = torch.cuda.device_count()
    assert json.loads((tmp_path / "result.json").read_text()) == {
        "status": f"skipped: {gpus} GPU(s)", "ranks": gpus, "device": "cuda",
    }  # fmt: skip
    assert not (tmp_path / "model").exists()  # nothing ran


@pytest.fixture(scope="module")
def leg(tmp_path_factory):
    """The whole leg on 2 CPU processes, run once for the tests that read it, through gpu_check as a GPU
    machine runs it: (the leg's result, gpu_check's report, gpu_check's process)."""
    out = tmp_path_factory.mktemp("multi") / "check.json"
    command = ["scripts/gpu_check.py", "--device", "cpu", "--tiny", "--only", "multi", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=900
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert list(report["parts"]) == ["multi"], result.stdout[-3000:] + result.stderr[-3000:]
    return report["parts"]["multi"]["figures"], report, result


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero2_on_two_ranks_applies_the_one_process_gradient(leg):
    report, _, result = leg
    zero2 = report["checks"]["zero2"]
    assert zero2["status"] == "ok", zero2.get("log_tail") or result.stdout[-3000:]
    assert (zero2["backend"], zero2["world_size"], report["ranks"]) == ("gloo", 2, 2)
    assert len(zero2["relative_error_by_step"]) == 2 and max(zero2["relative_error_by_step"]) < 1e-4
    assert "    zero2   2 ranks  ok      gradient off by" in result.stdout  # gpu_check's table


@pytest.mark.slow
@pytest.mark.multiprocess
def test_zero3_on_two_ranks_applies_the_one_process_gradient(leg):
    report, check, result = leg
    zero3 = report["checks"]["zero3"]
    assert (zero3["backend"], zero3["world_size"]) == ("gloo", 2)
    assert zero3["status"] == "ok", zero3["relative_error_by_step"]
    assert check["parts"]["multi"]["status"] == "ok" and result.returncode == 0  # every check passed


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_stopped_and_resumed_with_last_end_bitwise_where_the_straight_run_does(leg):
    report, _, result = leg
    resume = report["checks"]["resume"]
    assert resume["status"] == "ok", resume.get("log_tail") or result.stdout[-3000:]
    assert resume["bitwise"] and (resume["stopped_at"], resume["steps"]) == (2, 4)
    assert min(resume["replayed_after_resume_by_rank"]) > 0 and len(resume["buffer_rows_by_rank"]) == 2
    assert "bitwise after stop at step 2 and resume to 4" in result.stdout

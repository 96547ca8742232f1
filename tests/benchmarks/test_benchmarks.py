"""The benchmark scripts still run end to end (tiny sizes, results into a temporary directory).

They are measurements, not tests: these only keep them from rotting as the library changes. Marked slow.
"""

import importlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from exgrpo_pl.experience.buffer import STRATEGIES

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
pytestmark = pytest.mark.slow


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """Imports a benchmark script as a module, its RESULTS (if it writes any) redirected to tmp_path, and
    runs its main(); then restores torch's thread count, which several scripts set to 1."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import one another; spawned workers too
    threads = torch.get_num_threads()

    def run(name: str, *argv: str):
        module = importlib.import_module(name)
        if hasattr(module, "RESULTS"):
            monkeypatch.setattr(module, "RESULTS", tmp_path)
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
        module.main()
        return tmp_path

    yield run
    torch.set_num_threads(threads)


def test_buffer_benchmark(bench):
    result = json.loads((bench("buffer", "--quick", "--samples", "3") / "buffer_quick.json").read_text())
    assert result["size"] == 20_000 // 256 * 256
    assert set(result["sample"]) == set(STRATEGIES)
    assert all(figures["rows"] == 256 for figures in result["sample"].values())
    assert 1.0 < result["memory_ratio"] < 2.0


def test_overhead_benchmark(bench):
    out = bench("overhead", "--quick", "--rounds", "1", "--steps", "8")
    result = json.loads((out / "overhead_quick.json").read_text())
    assert set(result) == {"GRPO", "GRPO log every step", "ExGRPO mix", "ExGRPO mix capped", "ExGRPO swap"}
    assert result["GRPO"]["bookkeeping_share"] == [0.0]
    assert result["ExGRPO mix"]["bookkeeping_share"][0] > 0.0
    assert (out / "overhead_quick.png").exists()


def test_learning_benchmark(bench):
    names = ("GRPO", "ExGRPO paper", "paper, retire from buffer, bounded demand")
    # The code the runs start from, read before they start: a commit made meanwhile must not fail the test.
    started_at = importlib.import_module("learning").code_version()  # `bench` put benchmarks/ on the path
    out = bench("learning", "--quick", "--seeds", "1", "--steps", "4", "--variants", *names)
    result = json.loads((out / "learning_quick.json").read_text())
    assert set(result["runs"]) == set(importlib.import_module("learning").TASKS)
    for task, variants in result["runs"].items():
        assert set(variants) == set(names)
        for (run,) in variants.values():
            steps = [point[0] for point in run["curve"]]
            tokens = [point[1] for point in run["curve"]]
            assert steps[0] == 0 and steps[-1] == 4 and tokens == sorted(tokens) and tokens[-1] > 0
            assert run["commit"] == started_at  # the code it ran
            assert run["machine"] == importlib.import_module("learning").machine()  # and where
        assert variants["GRPO"][0]["diagnostics"]["replays"] == 0
        assert variants["GRPO"][0]["diagnostics"]["completion_tokens"]["replayed"] is None
        summary = result["summary"][task]
        assert summary["token_budget"] <= min(v[0]["curve"][-1][1] for v in variants.values())
        assert (out / f"learning_{task}_quick.png").exists() and (
            out / f"learning_{task}_replay_quick.png"
        ).exists()


def test_learning_yardstick_benchmark(bench):
    names = ("GRPO", "ExGRPO recommended")
    out = bench(
        "learning_yardstick", "--tasks", "weak_start", "--variants", *names, "--seeds", "1", "--steps", "3"
    )
    result = json.loads((out / "learning_yardstick.json").read_text())
    row = result["summary"]["weak_start"]["ExGRPO recommended"]
    assert row["OOD greedy"]["vs_grpo"][1] == 0.0  # one seed: a difference without an interval
    assert "T=1 at equal fresh questions" in row
    assert (out / "learning_yardstick.png").stat().st_size > 0
    for name in names:
        (run,) = result["runs"]["weak_start"][name]
        assert run["curve"][-1][0] == 3  # the final weights of a 3-step run of learning.py's
        # 32 fresh questions a step, none replayed in 3 steps (the replay trigger has not fired)
        assert [trained for trained, _ in run["fresh_questions"]] == [0, 32, 64, 96]
        for name in ("id", "ood"):
            assert {"avg@4", "greedy_pass@1", "pass@4"} <= set(run["final"][name])
        assert run["final"]["ood"]["problems"] == 500
        assert run["final"]["id"]["samples"] == 4 * run["final"]["id"]["problems"]


def test_evaluation_speed_benchmark(bench):
    out = bench("evaluation_speed", "--rounds", "1", "--problems", "16", "--steps", "1")
    result = json.loads((out / "evaluation_speed.json").read_text())
    (figures,) = result["rounds"]
    assert figures["ratio"] == pytest.approx(
        figures["eval_completions_per_s"] / figures["train_completions_per_s"]
    )
    assert result["problems"] == 16 and result["samples"] == 4


def test_memory_benchmark(bench):
    out = bench("memory", "--quick", "--no-baseline", "--stored", "64")
    result = json.loads((out / "memory_quick.json").read_text())["cpu"]
    assert set(result["step"]["after"]) == {"GRPO", "paper preset (64 stored)"}
    assert result["step"]["after"]["paper preset (64 stored)"]["rescored_rows"] == 64
    assert result["softmax"]["within_1e-6"] and result["softmax"]["chunk_size_independent"]
    engine = result["engine"]
    # 16 rows x 96 slots (64 + 16 rounded up) x 2 layers x keys and values x 2 heads x 16 dims in bf16
    assert engine["static"]["kv_arena"] == 16 * 96 * 2 * 2 * 2 * 16 * 2 and engine["hf"]["kv_arena"] == 0
    assert engine["static"]["tokens"] == engine["hf"]["tokens"] == 16 * 16  # the full budget, no stop token
    assert (out / "memory_quick.png").exists()


def test_contract_checks_benchmark(bench):
    result = json.loads((bench("contract_checks", "--steps", "4") / "contract_checks.json").read_text())
    for mode in ("mix", "swap"):
        assert result[mode]["steps"] == 4 and "fresh" in result[mode]["checks_us_first_step_of_each_kind"]
    assert result["large_mixed_batch_1024_rows"]["check_rollouts_us"] > 0


def test_generation_benchmark(bench):
    argv = ["--mode", "embedded", "--rows", "4", "--new-tokens", "6", "--rounds", "2"]
    out = bench("generation", *argv, "--engines", "hf", "static-eager")
    result = json.loads((out / "generation.json").read_text())["embedded"]
    assert set(result["engines"]) == {"hf", "static-eager"}
    assert result["rows"] == 4 and result["new_tokens"] == 6
    assert result["engines"]["hf"]["ratio_to_hf"] == 1.0
    assert all(len(entry["tokens_per_s"]) == 2 for entry in result["engines"].values())
    assert (out / "generation.png").exists()


def test_checkpoint_cost_benchmark(bench, tmp_path):
    out = bench("checkpoint_cost", "--sizes", "5", "--repeats", "1", "--dir", str(tmp_path))
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint_cost.json"]  # its checkpoints are removed
    (figures,) = json.loads((out / "checkpoint_cost.json").read_text()).values()
    assert 4e6 < figures["parameters"] < 6e6
    # fp32 weights and Adam's two moments: about three times the weights
    assert 2.5 < figures["checkpoint_mb"] * 2**20 / (4 * figures["parameters"]) < 3.5
    assert all(value > 0 for key, value in figures.items() if key.endswith("_s"))
    share = figures["finite_check_s"] / figures["save_atomically_s"]
    assert figures["finite_check_share_of_save"] == pytest.approx(share)


def test_checkpoint_kill_benchmark(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("KILL_TRIALS_DIR", str(tmp_path))
    out = bench("checkpoint_kill", "--trials", "1", "--ballast-mb", "4")
    result = json.loads((out / "checkpoint_kill.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint_kill.json"]  # its runs' folders are removed
    assert {(row["writer"], row["tmpdir"], row["trials"]) for row in result["summary"]} == {
        (writer, tmpdir, 1)
        for writer in ("exgrpo", "lightning")
        for tmpdir in ("same filesystem", "other filesystem")
    }
    assert len(result["trials"]) == 4 and all(t["killed_exitcode"] == -9 for t in result["trials"])
    for trial in result["trials"]:
        if trial["writer"] == "exgrpo":  # what the atomic writer promises, wherever the kill lands
            assert trial["resume"] == "resumed" and not trial["after_kill"]["unloadable"]
            assert not trial["after_resume"]["temp_files"]


def test_reasoning_budget_benchmark(bench, capsys):
    bench("reasoning_budget", *"--batch-sizes 2 4 --steps 2 --skip 1 --run --run-steps 5".split())
    printed = capsys.readouterr().out
    table = printed[printed.index("batch  step CPU") :].splitlines()[1:3]
    for line, batch_size in zip(table, (2, 4)):
        batch, cpu, wall, generate, reward, fwd_bwd, tokens, validation = line.split()
        assert int(batch) == batch_size and float(reward) >= 0  # printed to the ms: may read 0.000
        assert all(float(seconds) > 0 for seconds in (cpu, wall, generate, fwd_bwd, validation))
        assert 1 <= float(tokens) <= 29  # the config's max_completion_length
    assert "configs/quickstart_reasoning.yaml: 5 steps" in printed
    assert 0 <= float(re.search(r"val pass@1 at step: 0: ([0-9.]+)", printed)[1]) <= 1
    assert re.search(r"drawn 160 \(", printed)  # 5 steps of 32 questions


def test_reward_timeout_benchmark(bench):
    results = bench("reward_timeout", "--calls", "20", "--rounds", "2")
    rewards = json.loads((results / "reward_timeout.json").read_text())["rewards"]
    assert rewards["ArithmeticReward"]["path"] == "direct"
    assert rewards["FormatReward"]["path"] == "worker process"
    for measured in rewards.values():
        assert all(len(times) == 2 and min(times) > 0 for times in measured["rounds"].values())


def test_hostile_probes_benchmark(bench):
    results = bench("hostile_probes", "--only", "learning_rate")
    (probe,) = json.loads((results / "hostile_probes.json").read_text())
    assert probe["probe"] == "6 learning_rate 1e38" and probe["outcome"] == "clear error"


def test_resume_exact_benchmark(bench):
    args = ("--configs", "exgrpo_swap", "--steps", "12", "--questions", "200")  # 5 steps an epoch
    result = json.loads((bench("resume_exact", *args) / "resume_exact.json").read_text())
    assert list(result) == ["exgrpo_swap/mid", "exgrpo_swap/kill", "exgrpo_swap/end"]
    assert all(case["exact"] for case in result.values()), result
    mid, kill, end = result.values()
    assert (mid["resumed_from_step"], end["resumed_from_step"], end["steps_per_epoch"]) == (6, 5, 5)
    assert 4 <= kill["resumed_from_step"] < 12  # the validation checkpoint of step 4, or a later one
    # a meaningful resume: experience stored and questions retired by the end (the swap preset replays
    # from epoch 1 with probability 0.3 a step: none of this run's 7 steps there happens to); the preset
    # retires from the buffer only, so the fresh stream still holds every question
    assert end["buffer_rows"] > 0 and end["retired"] > 0 and end["excluded_from_stream"] == 0


def test_vs_trl_benchmark(bench):
    pytest.importorskip("trl")
    out = bench("vs_trl", "--rounds", "1", "--steps", "7")
    result = json.loads((out / "vs_trl.json").read_text())
    assert set(result) == {"TRL", "exgrpo-pl"}
    for (run,) in result.values():
        assert run["step_s"] > 0 and run["peak_bytes"] > 100 * 2**20
    assert (out / "vs_trl.png").exists()


def test_vs_trl_profile_names_functions_that_exist():
    """A moved or renamed function would silently drop out of its profile category (counted as framework
    time), so every entry point of ours must name a function defined in that file."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        categories = importlib.import_module("vs_trl").CATEGORIES
    finally:
        sys.path.remove(str(BENCHMARKS))
    ours = [entry for entries in categories.values() for entry in entries if entry.startswith("exgrpo_pl/")]
    assert ours
    for entry in ours:
        path, function = entry.split(":")
        source = (BENCHMARKS.parent / path).read_text()
        assert re.search(rf"^\s*def {function}\(", source, re.M), f"{entry}: no such function"


def test_prompt_check_benchmark(bench):
    result = json.loads(
        (bench("prompt_check", "--rows", "300", "--repeats", "2") / "prompt_check.json").read_text()
    )
    (figures,) = result.values()
    assert figures["rows"] == 300 and len(figures["seconds"]) == 2 and all(s > 0 for s in figures["seconds"])
    assert figures["median"] == pytest.approx(sum(figures["seconds"]) / 2)


def test_quickstart_speed_benchmark(bench):
    result = json.loads((bench("quickstart_speed", "--baseline", "HEAD", "--rounds", "1", "--steps", "3")
                         / "quickstart_speed.json").read_text())  # fmt: skip
    assert result["steps"] == 3 and len(result["seconds"]) == 2
    assert all(len(times) == 1 and times[0] > 0 for times in result["seconds"].values())
    assert result["ratio"] > 0


def test_refill_cost_benchmark(bench):
    out = bench("refill_cost", "--steps", "3", "--repeats", "2")
    result = json.loads((out / "refill_cost.json").read_text())
    assert set(result) == {"GRPO", "displace", "refill", "fresh refill", "dynamic sampling", "setup"}
    assert result["GRPO"]["tokens_vs_grpo"] == 1.0 and result["refill"]["tokens_per_step"] > 0
    # Each repeat's GRPO run is its own yardstick: GRPO over itself is 1 in every repeat.
    assert result["GRPO"]["seconds_vs_grpo"] == {"mean": 1.0, "low": 1.0, "high": 1.0}
    ratio = result["refill"]["seconds_vs_grpo"]
    assert 0 < ratio["low"] <= ratio["mean"] <= ratio["high"] and result["setup"]["repeats"] == 2
    assert result["GRPO"]["rounds_per_step"] == 1.0 and result["dynamic sampling"]["rounds_per_step"] >= 1


def test_every_benchmark_script_has_a_smoke_test():
    tested = set(re.findall(r'bench\(\s*"(\w+)"', Path(__file__).read_text()))
    assert {path.stem for path in BENCHMARKS.glob("*.py")} - tested == set()


def test_cpu_kernels_benchmark(bench):
    out = bench("cpu_kernels", "--steps", "1", "--rounds", "1", "--settings", "one thread")
    result = json.loads((out / "cpu_kernels.json").read_text())
    assert result["steps"] == 1 and len(result["runs"]) == 3  # and the timed pair
    assert sum(len(names) for names in result["same_losses"]) == len(result["runs"])
    # The thread count changes no loss (the kernels' reductions do not depend on it).
    assert any({"this CPU's kernels", "one thread"} <= set(names) for names in result["same_losses"])
    assert result["portable_over_native"] > 0


def test_hypotheses_benchmark(bench, tmp_path, capsys):
    from test_hypotheses import make_run

    runs = {"weak_start": {name: [make_run(seed, 0.3 + 0.01 * seed) for seed in range(5)]
                           for name in ("GRPO", "recommended, displace")}}  # fmt: skip
    (tmp_path / "learning_yardstick.json").write_text(json.dumps({"runs": runs}))
    bench("hypotheses")
    claim = "on the weak start, the recommended preset (then placement displace) ends above GRPO"
    assert f"| H2 | {claim} | **undecided** |" in capsys.readouterr().out


def test_headline_benchmark(bench, tmp_path, capsys):
    shutil.copy(BENCHMARKS / "results" / "dynamic_sampling.json", tmp_path / "dynamic_sampling.json")
    bench("headline")
    printed = capsys.readouterr().out
    assert "recommended preset" in printed and "weak start" in printed and "±" in printed
    answer = importlib.import_module("headline").answer(
        json.loads((tmp_path / "dynamic_sampling.json").read_text())
    )
    assert "replayed vs fresh questions" in printed and answer in printed
    assert (tmp_path / "headline.png").stat().st_size > 0

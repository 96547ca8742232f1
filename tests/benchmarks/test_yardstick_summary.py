"""The yardstick benchmark's summary: the T = 1 curve read at equal generated tokens, and at equal fresh
questions for runs that recorded them, with a dash in the table for runs that did not; what a rerun
drops; and which kept runs ran on another machine (both benchmarks' `--resume` say)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from learning import from_elsewhere  # noqa: E402
from learning_yardstick import (  # noqa: E402
    EQUAL_FRESH,
    EQUAL_TOKENS,
    MEASURES,
    TOKENS_VS_GRPO,
    summarise,
    table,
    without_runs,
)


def make_run(seed: int, final: float, fresh: list | None = None, tokens: float = 100.0) -> dict:
    run = {
        "seed": seed,
        "curve": [(0, 0.0, 0.3), (10, tokens, final)],
        "final": {"id": {}, "ood": {}},
    }
    for name, metric in MEASURES:
        run["final"][name][metric] = final
    if fresh is not None:
        run["fresh_questions"] = fresh
    return run


def test_equal_fresh_questions_read_each_curve_where_every_recording_run_got_to():
    runs = {
        "GRPO": [make_run(0, 0.50, [(0, 0), (320, 320)])],
        # replayed half of its steps' questions: 160 fresh by the end; GRPO is read at 160 too
        "ExGRPO paper": [make_run(0, 0.46, [(0, 0), (160, 160)])],
    }
    rows = summarise({"reasoning": runs})["reasoning"]
    assert rows["GRPO"][EQUAL_FRESH]["mean"][0] == pytest.approx(0.40)
    assert rows["ExGRPO paper"][EQUAL_FRESH]["mean"][0] == pytest.approx(0.46)
    assert rows["ExGRPO paper"][EQUAL_FRESH]["vs_grpo"][0] == pytest.approx(6.0)


def test_runs_that_did_not_record_fresh_questions_show_a_dash():
    runs = {"GRPO": [make_run(0, 0.50)], "ExGRPO paper": [make_run(0, 0.46, [(0, 0), (160, 160)])]}
    summary = summarise({"reasoning": runs})
    assert EQUAL_FRESH not in summary["reasoning"]["GRPO"]
    assert summary["reasoning"]["ExGRPO paper"][EQUAL_FRESH]["vs_grpo"] is None  # GRPO has none to pair
    lines = table(summary).splitlines()
    columns = next(line for line in lines if line.startswith("| variant")).split(" | ")
    grpo_row = next(line for line in lines if line.startswith("| GRPO")).split(" | ")
    assert grpo_row[columns.index(EQUAL_FRESH)] == "—"


def test_equal_tokens_read_each_curve_at_the_tokens_every_run_generated():
    # Refill generated a quarter more than GRPO in as many steps: both are read at GRPO's 100 tokens.
    runs = {"GRPO": [make_run(0, 0.50)], "ExGRPO recommended": [make_run(0, 0.55, tokens=125.0)]}
    rows = summarise({"reasoning": runs})["reasoning"]
    assert rows["GRPO"][EQUAL_TOKENS]["mean"][0] == pytest.approx(0.50)
    assert rows["ExGRPO recommended"][EQUAL_TOKENS]["mean"][0] == pytest.approx(0.3 + 0.25 * 0.8)
    assert rows["ExGRPO recommended"][EQUAL_TOKENS]["vs_grpo"][0] == pytest.approx(0.0)
    assert rows["ExGRPO recommended"]["ours: val pass@1, T=1"]["vs_grpo"][0] == pytest.approx(5.0)


def test_the_table_gives_the_tokens_each_variant_generated_over_grpos_at_the_same_seeds():
    runs = {
        "GRPO": [make_run(0, 0.50), make_run(1, 0.50, tokens=200.0)],
        "ExGRPO recommended": [make_run(0, 0.55, tokens=120.0), make_run(1, 0.55, tokens=240.0)],
    }
    summary = summarise({"reasoning": runs})["reasoning"]
    assert summary["ExGRPO recommended"][TOKENS_VS_GRPO] == pytest.approx((1.2, 0.0))
    assert summary["GRPO"][TOKENS_VS_GRPO] is None
    lines = table({"reasoning": summary}).splitlines()
    assert next(line for line in lines if line.startswith("| ExGRPO recommended")).endswith("| 1.20 ± 0.00 |")


def test_a_rerun_drops_the_runs_of_its_variants_on_its_tasks_and_keeps_every_other():
    results = {
        "reasoning": {"GRPO": [make_run(0, 0.5)], "ExGRPO paper": [make_run(0, 0.4)]},
        "arithmetic": {"GRPO": [make_run(0, 0.5)], "ExGRPO paper": [make_run(0, 0.4)]},
    }
    kept = without_runs(results, ["reasoning"], ["ExGRPO paper"])
    assert {task: sorted(by_variant) for task, by_variant in kept.items()} == {
        "reasoning": ["GRPO"], "arithmetic": ["ExGRPO paper", "GRPO"],
    }  # fmt: skip
    assert "ExGRPO paper" in results["reasoning"]  # the file's rows are left as they were until rewritten


def test_resuming_names_the_other_machines_the_kept_runs_ran_on():
    here, there = "CPU A, AVX512, torch 2.13.0+cpu", "CPU B, AVX2, torch 2.13.0+cpu"
    results = {
        "reasoning": {
            "GRPO": [{**make_run(0, 0.5), "machine": here}, {**make_run(1, 0.5), "machine": there}]
        },
        "arithmetic": {"GRPO": [make_run(0, 0.5), {**make_run(1, 0.5), "machine": there}]},
    }
    assert from_elsewhere(results, here) == [there, "unrecorded"]
    assert from_elsewhere(results, there) == [here, "unrecorded"]
    assert from_elsewhere({"reasoning": {"GRPO": [{**make_run(0, 0.5), "machine": here}]}}, here) == []

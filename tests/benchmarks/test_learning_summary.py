"""The learning benchmark's summary: exact small cases for what its README tables are made of."""

import sys
from pathlib import Path

import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from learning import markdown_table, summarise  # noqa: E402


def make_run(seed: int, final: float, replays: int = 0) -> dict:
    curve = [(0, 0.0, 0.3), (10, 1000.0 + seed, final)]
    diagnostics = {"replays": replays, "distinct_questions": replays // 2, "max_replays_per_question": 2}
    return {"seed": seed, "commit": "abc", "curve": curve, "diagnostics": diagnostics}


def test_vs_grpo_pairs_the_seeds_both_ran():
    runs = {
        "GRPO": [make_run(0, 0.50), make_run(1, 0.60)],
        # seed 2 has no GRPO run to pair with: left out of the difference, kept in the variant's own mean
        "ExGRPO paper": [make_run(1, 0.57, 40), make_run(0, 0.52, 40), make_run(2, 0.90, 40)],
    }
    rows = summarise({"reasoning": runs})["reasoning"]["variants"]
    assert rows["GRPO"]["vs_grpo_points"] is None
    mean, half = rows["ExGRPO paper"]["vs_grpo_points"]
    spread = stats.tstd([2.0, -3.0]) / 2**0.5  # differences +2 (seed 0) and -3 (seed 1) points
    assert mean == pytest.approx(-0.5) and half == pytest.approx(stats.t.ppf(0.975, 1) * spread)
    assert rows["ExGRPO paper"]["final"][0] == pytest.approx((0.57 + 0.52 + 0.90) / 3)
    assert rows["ExGRPO paper"]["replays"] == (40, 0.0)


def test_markdown_table_lists_variants_in_the_benchmarks_order_with_the_papers_numbers():
    runs = {"ExGRPO paper": [make_run(0, 0.52, 40)], "GRPO": [make_run(0, 0.50)]}
    table = markdown_table(summarise({"arithmetic": runs})["arithmetic"]["variants"]).splitlines()
    assert table[2] == "| GRPO | 1 | 0.500 ± 0.000 | — | 0.500 ± 0.000 | 45.3 | — | — |"
    assert (
        table[3]
        == "| ExGRPO paper | 1 | 0.520 ± 0.000 | +2.0 ± 0.0 | 0.520 ± 0.000 | 48.3, +3.0 | 40 (20) | 2 |"
    )

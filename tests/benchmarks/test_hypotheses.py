"""The rule that decides the learning page's hypotheses: paired intervals against the margins written before
the runs, a hypothesis's comparisons combined, and the rule for the recommended preset's default."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from hypotheses import (  # noqa: E402
    DECIDING,
    OFFICIAL_PICK,
    OFFICIAL_PICK_COMPARED,
    SEEDS,
    Hypothesis,
    decide,
    paired,
    recommended_takes_defer,
    reported_table,
    verdict,
)
from learning_yardstick import MEASURES  # noqa: E402


@pytest.mark.parametrize(
    ("intervals", "relation", "expected"),
    [
        ([(0.5, 1.0), (0.2, 1.1)], "at or above", "holds"),  # lower bounds -0.5 and -0.9, above -1
        ([(0.5, 1.0), (0.0, 1.5)], "at or above", "undecided"),  # -1.5 is not above -1
        ([(0.5, 1.0), (-2.0, 1.5)], "at or above", "fails"),  # upper bound -0.5 below 0
        ([(0.5, 1.0), (0.2, 1.1)], "above", "undecided"),  # level: neither above nor below
        ([(2.0, 1.0), (1.5, 1.0)], "above", "holds"),
        ([(2.0, 1.0), (-1.5, 1.0)], "above", "fails"),  # one figure below decides
    ],
)
def test_verdict_follows_the_margins_written_beforehand(intervals, relation, expected):
    assert verdict(intervals, relation) == expected


def make_run(seed: int, value: float) -> dict:
    """A run whose every figure is `value`."""
    final = {"id": {}, "ood": {}}
    for name, metric in MEASURES:
        final[name][metric] = value
    return {"seed": seed, "curve": [(0, 0.0, 0.1), (10, 1.0, value)], "final": final}


def runs_of(task: str, **variants: list[float]) -> dict:
    return {task: {name.replace("_", " "): [make_run(s, v) for s, v in enumerate(values)]
                   for name, values in variants.items()}}  # fmt: skip


def test_paired_differences_are_in_points_by_seed():
    runs = runs_of("t", A=[0.50, 0.52, 0.54, 0.56, 0.58], B=[0.49, 0.51, 0.53, 0.55, 0.57])
    mean, half = paired(runs, "t", "A", "B", DECIDING[0])
    assert mean == pytest.approx(1.0) and half == pytest.approx(0.0, abs=1e-9)


def test_the_reported_comparisons_print_paired_differences_without_a_verdict():
    runs = {
        task: {
            "ExGRPO paper": [make_run(s, 0.40 + 0.01 * s) for s in range(SEEDS)],
            "paper, before exact": [make_run(s, 0.42 + 0.01 * s) for s in range(SEEDS)],
        }
        for task in ("arithmetic", "reasoning")
    }
    lines = reported_table({"learning_yardstick": runs}).splitlines()
    row = next(line for line in lines if "| arithmetic |" in line)
    assert "ours: val pass@1, T=1: -2.0 ± 0.0; ID avg@4, T=0.6: -2.0 ± 0.0" in row
    assert "holds" not in row and "fails" not in row
    unmeasured = next(line for line in lines if "| small_pool |" in line)  # no runs: no figures
    assert unmeasured.endswith("ours: val pass@1, T=1: —; ID avg@4, T=0.6: — |")


def test_the_official_pick_is_compared_on_the_runs_of_its_own_file():
    """Both picks ran at one commit into `OFFICIAL_PICK`; the older rows of the same names are not paired."""

    def both_picks(official: float) -> dict:
        return {
            "reasoning": {
                "recommended, official trajectory pick": [
                    make_run(s, official + 0.01 * s) for s in range(SEEDS)
                ],
                "ExGRPO recommended": [make_run(s, 0.50 + 0.01 * s) for s in range(SEEDS)],
            }
        }

    def row(files: dict) -> str:
        header, rule, *rows = reported_table(files, only=OFFICIAL_PICK_COMPARED).splitlines()
        assert all(line.startswith(f"| {OFFICIAL_PICK_COMPARED} |") for line in rows) and len(rows) == 4
        return next(line for line in rows if "| reasoning |" in line)

    assert "ours: val pass@1, T=1: +3.0 ± 0.0" in row({OFFICIAL_PICK: both_picks(0.53)})
    assert row({"learning_yardstick": both_picks(0.53)}).endswith(
        "ours: val pass@1, T=1: —; ID avg@4, T=0.6: — |"
    )


def test_a_comparison_needs_every_seed():
    runs = runs_of("t", A=[0.5] * (SEEDS - 1), B=[0.4] * SEEDS)
    assert paired(runs, "t", "A", "B", DECIDING[0]) is None


def test_a_hypothesis_holds_only_when_every_comparison_holds():
    runs = {
        **runs_of("one", A=[0.50, 0.51, 0.52, 0.50, 0.51], B=[0.50, 0.50, 0.51, 0.50, 0.50]),
        **runs_of("two", A=[0.50, 0.51, 0.52, 0.50, 0.51], B=[0.56, 0.58, 0.57, 0.56, 0.58]),
    }
    both = Hypothesis("H", "A at or above B", "at or above", (("one", "A", "B"), ("two", "A", "B")))
    (decided,) = decide({"learning_yardstick": runs}, (both,))
    assert [row["verdict"] for row in decided["comparisons"]] == ["holds", "fails"]
    assert decided["verdict"] == "fails"
    missing = Hypothesis("H", "A at or above B", "at or above", (("one", "A", "B"), ("three", "A", "B")))
    assert decide({"learning_yardstick": runs}, (missing,))[0]["verdict"] == "not measured"


def test_the_recommended_preset_defers_only_when_deferring_holds_everywhere_and_wins_somewhere():
    def h1(*intervals):
        rows = [
            {
                "a": "recommended, deferred",
                "verdict": verdict([i, i], "at or above"),
                "intervals": {"x": i, "y": i},
            }
            for i in intervals
        ]
        return [{"name": "H1", "comparisons": rows}]

    assert recommended_takes_defer(h1((0.5, 1.0), (2.0, 1.0)))  # holds on both, above on one
    assert not recommended_takes_defer(h1((0.5, 1.0), (0.4, 1.0)))  # holds on both, above on none
    assert not recommended_takes_defer(h1((3.0, 1.0), (-0.5, 1.0)))  # above on one, undecided on one


def test_a_hypothesis_reads_only_its_own_seeds():
    """Seeds past a hypothesis's count leave its verdict as it was: H1-H4 stay decided on seeds 0-4 when the
    ten-seed runs of H7 add seeds 5-9 to the same variants."""
    runs = runs_of("t", A=[0.51] * 5 + [0.0] * 5, B=[0.50] * 10)
    assert paired(runs, "t", "A", "B", DECIDING[0]) == pytest.approx((1.0, 0.0))
    mean, _ = paired(runs, "t", "A", "B", DECIDING[0], seeds=10)
    assert mean == pytest.approx(-24.5)  # (5 x +1 + 5 x -50) / 10
    assert paired(runs_of("t", A=[0.5] * 9, B=[0.4] * 9), "t", "A", "B", DECIDING[0], seeds=10) is None


def test_runs_still_going_pair_every_seed_both_ran():
    """`seeds=None`, for a table of runs still going: every shared seed, at least two."""
    runs = runs_of("t", A=[0.52, 0.53, 0.60], B=[0.50, 0.51])  # A's seed 2 has no B to pair with
    assert paired(runs, "t", "A", "B", DECIDING[0], seeds=None) == pytest.approx((2.0, 0.0))
    assert paired(runs_of("t", A=[0.52], B=[0.50, 0.51]), "t", "A", "B", DECIDING[0], seeds=None) is None


def test_a_hypothesis_that_asks_for_above_on_one_task_is_undecided_while_every_task_is_only_level():
    level = dict(A=[0.505, 0.495, 0.51, 0.49, 0.50], B=[0.50] * 5)  # +0.0 ± 1.0: at or above, not above
    ahead = dict(A=[0.53, 0.52, 0.54, 0.53, 0.52], B=[0.50] * 5)  # +2.8 ± 1.0: above
    runs = {**runs_of("one", **level), **runs_of("two", **level)}
    both_tasks = (("one", "A", "B"), ("two", "A", "B"))
    h6 = Hypothesis("H", "A at or above B, above on one", "at or above", both_tasks, above_on_one=True)
    assert [row["verdict"] for row in decide({"learning_yardstick": runs}, (h6,))[0]["comparisons"]] == [
        "holds",
        "holds",
    ]
    assert decide({"learning_yardstick": runs}, (h6,))[0]["verdict"] == "undecided"
    assert decide({"learning_yardstick": {**runs, **runs_of("two", **ahead)}}, (h6,))[0]["verdict"] == "holds"


def test_a_hypothesis_reads_the_runs_of_its_own_results_file():
    """H9 and H10 read the runs made at one commit (`ONE_COMMIT`), not the older rows of the same names."""
    ahead = runs_of("t", A=[0.53, 0.52, 0.54, 0.53, 0.52], B=[0.50] * 5)
    behind = runs_of("t", A=[0.45] * 5, B=[0.50] * 5)
    own = Hypothesis("H", "A above B", "above", (("t", "A", "B"),), results="one commit")
    files = {"learning_yardstick": behind, "one commit": ahead}
    assert decide(files, (own,))[0]["verdict"] == "holds"
    assert decide({"learning_yardstick": behind}, (own,))[0]["verdict"] == "not measured"

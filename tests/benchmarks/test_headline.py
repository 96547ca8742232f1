"""benchmarks/headline.py: the README's results table, read by variant name, with each row's commits."""

import statistics
import sys
from pathlib import Path

import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import headline  # noqa: E402
from learning_yardstick import EQUAL_TOKENS, MEASURES, TOKENS_VS_GRPO, summarise  # noqa: E402


def figure(mean, vs_grpo=None):
    return {"mean": (mean, 0.01), "vs_grpo": vs_grpo}


def results(vs_grpo=(2.0, 1.0)) -> dict:
    """Every task with GRPO, the recommended preset (`vs_grpo` from GRPO) and the paper's (-5 +- 1)."""
    summary, runs = {}, {}
    for task, _ in headline.TASKS:
        summary[task] = {
            "GRPO": {"seeds": 2, headline.AT_EQUAL_STEPS: figure(0.5), EQUAL_TOKENS: figure(0.4)},
            "ExGRPO recommended": {
                "seeds": 2, headline.AT_EQUAL_STEPS: figure(0.52, vs_grpo),
                EQUAL_TOKENS: figure(0.41, (0.5, 1.0)), TOKENS_VS_GRPO: (1.2, 0.0),
            },
            "ExGRPO paper": {
                "seeds": 1, headline.AT_EQUAL_STEPS: figure(0.45, (-5.0, 1.0)),
                EQUAL_TOKENS: figure(0.4, (0, 0)),
            },
        }  # fmt: skip
        runs[task] = {
            "GRPO": [{"seed": 1, "commit": "b" * 40}, {"seed": 0, "commit": "a" * 40}],
            "ExGRPO recommended": [{"seed": 0, "commit": "c" * 40}, {"seed": 1, "commit": "c" * 40}],
            "ExGRPO paper": [{"seed": 0, "commit": "d" * 40}],
        }
    return {"summary": summary, "runs": runs}


def test_a_row_shows_its_figures_with_the_difference_from_grpo_and_its_commits_in_seed_order():
    lines = headline.table(results()).splitlines()
    assert lines[0] == headline.HEADER and len(lines) == 2 + 3 * len(headline.TASKS)
    assert lines[2] == "| reasoning | GRPO | 2 | 0.500 ± 0.010 | 0.400 ± 0.010 | aaaaaaa, bbbbbbb |"
    assert lines[3] == (
        "| reasoning | recommended preset | 2 | 0.520 ± 0.010 (+2.0 ± 1.0) | 0.410 ± 0.010 (+0.5 ± 1.0) "
        "| ccccccc |"
    )


def test_a_variant_missing_from_the_results_file_is_named():
    missing = results()
    del missing["runs"]["small_pool"]["ExGRPO paper"]
    with pytest.raises(KeyError, match="no runs of 'ExGRPO paper' on 'small_pool'"):
        headline.table(missing)


@pytest.mark.parametrize(
    "vs_grpo, steps",
    [((2.0, 1.0), "above on four of the four tasks, level on none and below on none"),
     ((0.5, 1.0), "above on none of the four tasks, level on four and below on none"),
     ((-2.0, 1.0), "above on none of the four tasks, level on none and below on four")],
)  # fmt: skip
def test_the_verdict_counts_the_tasks_where_the_interval_clears_zero(vs_grpo, steps):
    at_steps, at_tokens, paper = headline.verdict(results(vs_grpo))
    assert at_steps == f"At equal training steps it ends against plain GRPO {steps}"
    assert at_tokens == (
        "read at equal generated tokens (it generates 1.20-1.20 times GRPO's), above on none, level on four "
        "and below on none"
    )
    assert paper == "ends below GRPO on four at equal steps"


def one_commit_run(seed: int, final: float, tokens: float, commit: str = "e" * 40) -> dict:
    """A run of `learning_yardstick.py`: its T = 1 curve ends at `final` after `tokens` generated tokens."""
    curve = [(0, 0.0, 0.3), (10, tokens / 2, (0.3 + final) / 2), (20, tokens, final)]
    final_measures = {"id": {}, "ood": {}}
    for name, metric in MEASURES:
        final_measures[name][metric] = final
    return {"seed": seed, "commit": commit, "curve": curve, "final": final_measures}


# Per variant: (final pass@1 at seeds 0, 1, 2, generated tokens of a run).
ONE_COMMIT = {
    "GRPO": ((0.50, 0.52, 0.54), 1000.0),
    "GRPO, dynamic sampling": ((0.60, 0.63, 0.66), 3000.0),
    "recommended, fresh refill": ((0.51, 0.53, 0.55), 1200.0),
    "ExGRPO recommended": ((0.56, 0.58, 0.60), 1200.0),
}


def at_grpo_tokens(final: float, tokens: float) -> float:
    """A run's curve read at GRPO's 1000 tokens: 1000 / `tokens` of its straight way from 0.3 to `final`."""
    return 0.3 + 1000.0 / tokens * (final - 0.3)


def one_commit_results(tasks=("reasoning", "weak_start")) -> dict:
    runs = {
        task: {
            variant: [one_commit_run(seed, final, tokens) for seed, final in enumerate(finals)]
            for variant, (finals, tokens) in ONE_COMMIT.items()
        }
        for task in tasks
    }
    return {"summary": summarise(runs), "runs": runs}


def test_the_one_commit_table_shows_the_tasks_whose_four_variants_share_two_seeds():
    results = one_commit_results()
    del results["runs"]["weak_start"]["GRPO, dynamic sampling"][1:]  # one seed so far: no interval yet
    lines = headline.one_commit_table(results).splitlines()
    assert lines[0] == headline.ONE_COMMIT_HEADER and len(lines) == 2 + len(headline.CONTROLS)
    assert lines[2] == "| reasoning | GRPO | 3 | 0.520 ± 0.050 | 0.520 ± 0.050 | 1 | eeeeeee |"
    at_budget = statistics.mean(at_grpo_tokens(final, 1200.0) for final in (0.56, 0.58, 0.60))
    assert lines[5].startswith(
        f"| reasoning | recommended preset (refill, replayed questions) | 3 | 0.580 ± 0.050 (+6.0 ± 0.0) | "
        f"{at_budget:.3f} ± 0.041 (+1.3 ± 0.8) | 1.20 |"
    )


def test_the_comparisons_pair_every_seed_both_ran_at_steps_and_at_tokens():
    results = one_commit_results(("reasoning",))
    del results["runs"]["reasoning"]["ExGRPO recommended"][2]  # seed 2 still running: pairs seeds 0 and 1
    results["runs"]["reasoning"]["ExGRPO recommended"][1]["curve"][-1] = (20, 1200.0, 0.59)
    (row,) = headline.comparisons_table(results).splitlines()[2:]
    cells = row.split(" | ")
    # replayed vs fresh at equal steps: +5 and +6 points, so 5.5 ± t(0.975, 1) * stdev / sqrt(2)
    assert cells[2].startswith(f"+5.5 ± {stats.t.ppf(0.975, 1) * stats.tstd([5.0, 6.0]) / 2**0.5:.1f}; ")
    dapo_at_tokens = [
        100 * (at_grpo_tokens(f, 3000.0) - g) for f, g in zip((0.60, 0.63, 0.66), (0.5, 0.52, 0.54))
    ]
    half = stats.t.ppf(0.975, 2) * stats.tstd(dapo_at_tokens) / 3**0.5
    at_steps = f"+11.0 ± {stats.t.ppf(0.975, 2) / 3**0.5:.1f}"  # +10, +11 and +12 points
    assert cells[3] == f"{at_steps}; {statistics.mean(dapo_at_tokens):+.1f} ± {half:.1f}"
    assert cells[5] == "3, 3, 3, 2" and cells[6] == "eeeeeee |"


def test_two_shared_seeds_are_the_fewest_a_comparison_reads():
    results = one_commit_results(("reasoning",))
    del results["runs"]["reasoning"]["ExGRPO recommended"][1:]
    with pytest.raises(ValueError, match="share fewer than two seeds on 'reasoning'"):
        headline.difference(results, "reasoning", "ExGRPO recommended", "GRPO", headline.AT_EQUAL_STEPS)
    assert headline.comparisons_table(results).count("\n") == 1  # the header alone, until a second seed


def test_the_one_commit_verdict_counts_tasks_per_comparison():
    at_steps, at_tokens, replayed, dapo, against_dapo = headline.one_commit_verdict(one_commit_results())
    assert at_steps == "At equal training steps it ends against plain GRPO above on two of the two tasks, " \
        "level on none and below on none"  # fmt: skip
    assert at_tokens.startswith(
        "read at equal generated tokens (it generates 1.20-1.20 times GRPO's), above on two"
    )
    assert replayed.endswith("replayed questions end above on two, level on none and below on none")
    assert dapo == (
        "DAPO's dynamic sampling ends against GRPO above on two, level on none and below on none at equal "
        "steps, and above on none, level on none and below on two at equal generated tokens (it generates "
        "3.00-3.00 times GRPO's)"
    )
    assert against_dapo.endswith("recommended preset ends above on two, level on none and below on none")


def test_the_one_commit_picture_waits_for_a_task_with_every_variant(tmp_path):
    results = one_commit_results()
    assert headline.plot_one_commit(results, tmp_path / "a.png") and (tmp_path / "a.png").stat().st_size > 0
    for task in ("reasoning", "weak_start"):
        del results["runs"][task]["GRPO"]
    assert not headline.plot_one_commit(results, tmp_path / "b.png") and not (tmp_path / "b.png").exists()

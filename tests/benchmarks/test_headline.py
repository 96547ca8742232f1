"""benchmarks/headline.py: the README's and the learning page's results, read from the one-commit runs."""

import statistics
import sys
from pathlib import Path

import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import headline  # noqa: E402
from learning_yardstick import MEASURES, summarise  # noqa: E402


def run(seed: int, final: float, tokens: float, commit: str = "e" * 40) -> dict:
    """A run of `learning_yardstick.py`: its T = 1 curve ends at `final` after `tokens` generated tokens."""
    curve = [(0, 0.0, 0.3), (10, tokens / 2, (0.3 + final) / 2), (20, tokens, final)]
    final_measures = {"id": {}, "ood": {}}
    for name, metric in MEASURES:
        final_measures[name][metric] = final
    return {"seed": seed, "commit": commit, "curve": curve, "final": final_measures}


# Per variant: (final pass@1 at seeds 0, 1, 2, generated tokens of a run).
VARIANTS = {
    "GRPO": ((0.50, 0.52, 0.54), 1000.0),
    "GRPO, dynamic sampling": ((0.60, 0.63, 0.66), 3000.0),
    "recommended, fresh refill": ((0.51, 0.53, 0.55), 1200.0),
    "ExGRPO recommended": ((0.56, 0.58, 0.60), 1200.0),
}


def at_grpo_tokens(final: float, tokens: float) -> float:
    """A run's curve read at GRPO's 1000 tokens: 1000 / `tokens` of its straight way from 0.3 to `final`."""
    return 0.3 + 1000.0 / tokens * (final - 0.3)


def measured(tasks=("reasoning", "weak_start")) -> dict:
    runs = {
        task: {
            variant: [run(seed, final, tokens) for seed, final in enumerate(finals)]
            for variant, (finals, tokens) in VARIANTS.items()
        }
        for task in tasks
    }
    return {"summary": summarise(runs), "runs": runs}


def test_the_table_shows_the_tasks_whose_four_variants_share_two_seeds():
    results = measured()
    del results["runs"]["weak_start"]["GRPO, dynamic sampling"][1:]  # one seed so far: no interval yet
    lines = headline.table(results).splitlines()
    assert lines[0] == headline.HEADER and len(lines) == 2 + len(headline.CONTROLS)
    assert lines[2] == "| reasoning | GRPO | 3 | 0.520 ± 0.050 | 0.520 ± 0.050 | 1 | eeeeeee |"
    at_budget = statistics.mean(at_grpo_tokens(final, 1200.0) for final in (0.56, 0.58, 0.60))
    assert lines[5].startswith(
        f"| reasoning | recommended preset (refill, replayed questions) | 3 | 0.580 ± 0.050 (+6.0 ± 0.0) | "
        f"{at_budget:.3f} ± 0.041 (+1.3 ± 0.8) | 1.20 |"
    )


def test_the_comparisons_pair_every_seed_both_ran_at_steps_and_at_tokens():
    results = measured(("reasoning",))
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
    results = measured(("reasoning",))
    del results["runs"]["reasoning"]["ExGRPO recommended"][1:]
    with pytest.raises(ValueError, match="share fewer than two seeds on 'reasoning'"):
        headline.difference(results, "reasoning", "ExGRPO recommended", "GRPO", headline.AT_EQUAL_STEPS)
    assert headline.comparisons_table(results).count("\n") == 1  # the header alone, until a second seed


def test_the_verdict_counts_tasks_per_comparison():
    at_steps, at_tokens, dapo, against_dapo = headline.verdict(measured())
    assert at_steps == (
        "At equal training steps the recommended preset ends against plain GRPO above on two of the two "
        "tasks, level on none and below on none"
    )
    assert at_tokens.startswith(
        "read at equal generated tokens (it generates 1.20-1.20 times GRPO's), above on two"
    )
    assert dapo == (
        "DAPO's dynamic sampling ends against GRPO above on two, level on none and below on none at equal "
        "steps, and above on none, level on none and below on two at equal generated tokens (it generates "
        "3.00-3.00 times GRPO's)"
    )
    assert against_dapo.endswith("recommended preset ends above on two, level on none and below on none")


def replayed_against_fresh(gains: dict[str, float], seeds: int = 10) -> dict:
    """Refill with fresh and with replayed questions on every task, 1200 generated tokens each: per seed,
    replayed questions end `gains[task]` points above fresh ones, 0.5 points more or less by turns."""
    runs = {}
    for task, _ in headline.TASKS:
        fresh = [0.5 + 0.01 * seed for seed in range(seeds)]
        gain = [(gains[task] + (0.5 if seed % 2 else -0.5)) / 100 for seed in range(seeds)]
        runs[task] = {
            "recommended, fresh refill": [run(seed, f, 1200.0) for seed, f in enumerate(fresh)],
            "ExGRPO recommended": [run(seed, f + g, 1200.0) for seed, (f, g) in enumerate(zip(fresh, gain))],
        }
    return {"runs": runs}


EVERY_TASK = {task: 2.0 for task, _ in headline.TASKS}
HOLDS = (
    "replayed questions beat fresh ones in dead groups' places by the rule written before the runs: at "
    "equal generated tokens they end at or above fresh ones on every task and above on four, by +1.0 to +2.0 "
    "points (per task, mean over seeds)"
)
UNDECIDED = "whether replay adds anything to filling dead groups is undecided"
FAILS = "the gain is filling dead groups, not replay"
NOT_MEASURED = "whether replay adds anything to filling dead groups is decided once"


@pytest.mark.parametrize(
    "gains, seeds, answer",
    [
        (EVERY_TASK | {"small_pool": 1.0}, 10, HOLDS),
        (dict.fromkeys(EVERY_TASK, 0.0), 10, UNDECIDED),
        (EVERY_TASK | {"arithmetic": -2.0}, 10, FAILS),
        (EVERY_TASK, 9, NOT_MEASURED),  # H9 reads 10 seeds
    ],
)
def test_the_answer_is_h9s_verdict_in_words(gains, seeds, answer):
    assert headline.answer(replayed_against_fresh(gains, seeds)).startswith(answer)


def test_the_picture_waits_for_a_task_with_every_variant(tmp_path):
    results = measured()
    assert headline.plot(results, tmp_path / "a.png") and (tmp_path / "a.png").stat().st_size > 0
    for task in ("reasoning", "weak_start"):
        del results["runs"][task]["GRPO"]
    assert not headline.plot(results, tmp_path / "b.png") and not (tmp_path / "b.png").exists()

"""benchmarks/headline.py: the README's results table, read by variant name, with each row's commits."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import headline  # noqa: E402
from learning_yardstick import EQUAL_TOKENS, TOKENS_VS_GRPO  # noqa: E402


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

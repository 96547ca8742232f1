"""The headline results tables of the README and the learning page, read from the yardstick benchmark's file.

GRPO, the recommended preset and the paper's preset on the four tasks: final validation pass@1 at T = 1 with
its 95% interval over seeds, at equal steps (the last validation) and at equal generated tokens (each curve
read at the fewest tokens any run of the task generated), each preset's paired difference from GRPO, the
seeds and the commits the rows ran at. Rows are looked up by variant name in
benchmarks/results/learning_yardstick.json (written by `benchmarks/learning_yardstick.py`), so rerunning
them changes the table, and the commits column says which code each row measured. The learning page's
verdict shows the same figures as differences from GRPO, one row a task (`gains_table`), and both pages say
in words what they show (`verdict`).

    python benchmarks/headline.py      # prints both tables and the words from the results file
"""

from __future__ import annotations

import json

from learning import RESULTS
from learning_yardstick import EQUAL_TOKENS, TOKENS_VS_GRPO

# (variant name in the results file, what a reader calls it)
PRESETS = (
    ("GRPO", "GRPO"),
    ("ExGRPO recommended", "recommended preset"),
    ("ExGRPO paper", "paper's preset"),
)
TASKS = (("reasoning", "reasoning"), ("arithmetic", "arithmetic"), ("small_pool", "small pool"),
         ("weak_start", "weak start"))  # fmt: skip
AT_EQUAL_STEPS = "ours: val pass@1, T=1"
HEADER = (
    "| task | preset | seeds | final pass@1, equal steps (vs GRPO, points) | at equal generated tokens "
    "(vs GRPO, points) | ran at commit |"
)


def commits(runs: list[dict]) -> str:
    """The distinct short commits of a variant's runs, in seed order."""
    ordered = sorted(runs, key=lambda run: run["seed"])
    return ", ".join(dict.fromkeys(run["commit"][:7] for run in ordered))


def cell(figure: dict) -> str:
    (mean, half), versus = figure["mean"], figure["vs_grpo"]
    return f"{mean:.3f} ± {half:.3f}" + (f" ({versus[0]:+.1f} ± {versus[1]:.1f})" if versus else "")


def table(results: dict) -> str:
    """The Markdown table of `results` (learning_yardstick.json's contents).

    Raises:
        KeyError: a task or variant of `PRESETS` x `TASKS` is not in the results file (naming it).
    """
    lines = [HEADER, "|---" * 6 + "|"]
    for task, task_name in TASKS:
        for variant, name in PRESETS:
            try:
                row, runs = results["summary"][task][variant], results["runs"][task][variant]
            except KeyError:
                raise KeyError(f"learning_yardstick.json has no runs of {variant!r} on {task!r}") from None
            lines.append(
                f"| {task_name} | {name} | {row['seeds']} | {cell(row[AT_EQUAL_STEPS])} | "
                f"{cell(row[EQUAL_TOKENS])} | {commits(runs)} |"
            )
    return "\n".join(lines)


GAINS_HEADER = (
    "| task | recommended vs GRPO, equal steps | at equal generated tokens | paper's preset vs GRPO, equal "
    "steps | at equal generated tokens | seeds: GRPO, recommended, paper | commits, same order |"
)


def gains_table(results: dict) -> str:
    """The learning page's verdict table: per task, each preset's paired difference from GRPO in points at
    equal steps and at equal generated tokens, the seeds and the commits (`table`'s, one row a task)."""
    lines = [GAINS_HEADER, "|---" * 7 + "|"]
    for task, task_name in TASKS:
        rows = [results["summary"][task][variant] for variant, _ in PRESETS]
        gains = [
            f"{row[figure]['vs_grpo'][0]:+.1f} ± {row[figure]['vs_grpo'][1]:.1f}"
            for row in rows[1:]
            for figure in (AT_EQUAL_STEPS, EQUAL_TOKENS)
        ]
        seeds = ", ".join(str(row["seeds"]) for row in rows)
        ran_at = "; ".join(commits(results["runs"][task][variant]) for variant, _ in PRESETS)
        lines.append(f"| {task_name} | " + " | ".join(gains) + f" | {seeds} | {ran_at} |")
    return "\n".join(lines)


WORDS = ("none", "one", "two", "three", "four")


def standing(results: dict, variant: str, figure: str) -> dict[str, int]:
    """On how many of `TASKS` a variant's paired interval against GRPO on `figure` is above zero (its lower
    bound above 0), below it (its upper bound below 0), or level (it holds 0)."""
    counts = {"above": 0, "level": 0, "below": 0}
    for task, _ in TASKS:
        mean, half = results["summary"][task][variant][figure]["vs_grpo"]
        counts["above" if mean - half > 0 else "below" if mean + half < 0 else "level"] += 1
    return counts


def verdict(results: dict) -> list[str]:
    """The phrases in which the README and the learning page say what the table shows, from `standing`."""

    def said(counts: dict[str, int], tasks: str = "") -> str:
        above, level, below = (WORDS[counts[key]] for key in ("above", "level", "below"))
        return f"above on {above}{tasks}, level on {level} and below on {below}"

    ours, paper = (name for name, _ in PRESETS[1:])
    ratios = [results["summary"][task][ours][TOKENS_VS_GRPO][0] for task, _ in TASKS]
    return [
        "At equal training steps it ends against plain GRPO "
        + said(standing(results, ours, AT_EQUAL_STEPS), f" of the {WORDS[len(TASKS)]} tasks"),
        f"read at equal generated tokens (it generates {min(ratios):.2f}-{max(ratios):.2f} times GRPO's), "
        + said(standing(results, ours, EQUAL_TOKENS)),
        f"ends below GRPO on {WORDS[standing(results, paper, AT_EQUAL_STEPS)['below']]} at equal steps",
    ]


def main() -> None:
    results = json.loads((RESULTS / "learning_yardstick.json").read_text())
    print(table(results), gains_table(results), *verdict(results), sep="\n\n")


if __name__ == "__main__":
    main()

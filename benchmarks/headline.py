"""The headline results tables of the README and the learning page, read from the yardstick benchmark's file.

GRPO, the recommended preset and the paper's preset on the four tasks: final validation pass@1 at T = 1 with
its 95% interval over seeds, at equal steps (the last validation) and at equal generated tokens (each curve
read at the fewest tokens any run of the task generated), each preset's paired difference from GRPO, the
seeds and the commits the rows ran at. Rows are looked up by variant name in
benchmarks/results/learning_yardstick.json (written by `benchmarks/learning_yardstick.py`), so rerunning
them changes the table, and the commits column says which code each row measured. The learning page's
verdict shows the same figures as differences from GRPO, one row a task (`gains_table`), and both pages say
in words what they show (`verdict`).

The one-commit runs of the dynamic-sampling control (benchmarks/results/dynamic_sampling.json: GRPO, DAPO's
dynamic sampling, refill with fresh questions and the recommended preset, refill with replayed questions) get
the same table (`one_commit_table`), their paired comparisons (`comparisons_table`), the words
(`one_commit_verdict`) and a picture against steps and against generated tokens (`plot_one_commit`), for the
tasks whose four variants have runs so far.

    python benchmarks/headline.py    # prints the tables and the words, draws benchmarks/results/headline.png
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypotheses import ONE_COMMIT, paired
from learning import BATCHES_AXIS, RESULTS, _pyplot, interval
from learning_yardstick import EQUAL_TOKENS, TOKENS_VS_GRPO, reading_budgets

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


def tally(intervals) -> dict[str, int]:
    """How many paired intervals (mean, half-width) are above zero (lower bound above 0), below it (upper
    bound below 0), or level (holding 0)."""
    counts = {"above": 0, "level": 0, "below": 0}
    for mean, half in intervals:
        counts["above" if mean - half > 0 else "below" if mean + half < 0 else "level"] += 1
    return counts


def standing(results: dict, variant: str, figure: str) -> dict[str, int]:
    """`tally` of a variant's paired intervals against GRPO on `figure` over `TASKS`."""
    return tally(results["summary"][task][variant][figure]["vs_grpo"] for task, _ in TASKS)


def said(counts: dict[str, int], tasks: str = "") -> str:
    """A `standing` in words: "above on three of the four tasks, level on one and below on none"."""
    above, level, below = (WORDS[counts[key]] for key in ("above", "level", "below"))
    return f"above on {above}{tasks}, level on {level} and below on {below}"


def verdict(results: dict) -> list[str]:
    """The phrases in which the README and the learning page say what the table shows, from `standing`."""
    ours, paper = (name for name, _ in PRESETS[1:])
    ratios = [results["summary"][task][ours][TOKENS_VS_GRPO][0] for task, _ in TASKS]
    return [
        "At equal training steps it ends against plain GRPO "
        + said(standing(results, ours, AT_EQUAL_STEPS), f" of the {WORDS[len(TASKS)]} tasks"),
        f"read at equal generated tokens (it generates {min(ratios):.2f}-{max(ratios):.2f} times GRPO's), "
        + said(standing(results, ours, EQUAL_TOKENS)),
        f"ends below GRPO on {WORDS[standing(results, paper, AT_EQUAL_STEPS)['below']]} at equal steps",
    ]


# The one-commit runs: (variant name in the results file, what a reader calls it), GRPO first.
CONTROLS = (
    ("GRPO", "GRPO"),
    ("GRPO, dynamic sampling", "dynamic sampling (DAPO)"),
    ("recommended, fresh refill", "refill, fresh questions"),
    ("ExGRPO recommended", "recommended preset (refill, replayed questions)"),
)
# (A, B, what a reader calls A against B): each reads as A's points over B's, paired by seed.
COMPARED = (
    ("ExGRPO recommended", "GRPO", "recommended vs GRPO"),
    ("ExGRPO recommended", "recommended, fresh refill", "replayed vs fresh questions"),
    ("GRPO, dynamic sampling", "GRPO", "dynamic sampling vs GRPO"),
    ("ExGRPO recommended", "GRPO, dynamic sampling", "recommended vs dynamic sampling"),
)
ONE_COMMIT_HEADER = (
    "| task | variant | seeds | final pass@1, equal steps (vs GRPO, points) | at equal generated tokens "
    "(vs GRPO, points) | generated tokens (x GRPO) | ran at commit |"
)


def measured_tasks(results: dict) -> list[tuple[str, str]]:
    """The `TASKS` on which the variants of `CONTROLS` have run two seeds in common so far (the fewest a
    paired interval takes)."""
    measured = []
    for task, name in TASKS:
        runs = results["runs"].get(task, {})
        seeds = [{run["seed"] for run in runs.get(variant, [])} for variant, _ in CONTROLS]
        if len(set.intersection(*seeds)) >= 2:
            measured.append((task, name))
    return measured


def one_commit_table(results: dict) -> str:
    """`table` for the one-commit runs (dynamic_sampling.json's contents), with each variant's generated
    tokens over GRPO's at the same seeds."""
    lines = [ONE_COMMIT_HEADER, "|---" * 7 + "|"]
    for task, task_name in measured_tasks(results):
        for variant, name in CONTROLS:
            row, runs = results["summary"][task][variant], results["runs"][task][variant]
            tokens = row[TOKENS_VS_GRPO]
            lines.append(
                f"| {task_name} | {name} | {row['seeds']} | {cell(row[AT_EQUAL_STEPS])} | "
                f"{cell(row[EQUAL_TOKENS])} | {f'{tokens[0]:.2f}' if tokens else '1'} | {commits(runs)} |"
            )
    return "\n".join(lines)


def difference(results: dict, task: str, a: str, b: str, figure: str) -> tuple[float, float]:
    """A's `figure` minus B's on a task in points, paired over every seed both ran: mean, 95% half-width."""
    found = paired(results["runs"], task, a, b, figure, seeds=None)
    if found is None:
        raise ValueError(f"{a!r} and {b!r} share fewer than two seeds on {task!r}")
    return found


def comparisons_table(results: dict) -> str:
    """Per task, each of `COMPARED` in points at equal steps and at equal generated tokens, paired by seed,
    with the seeds each variant ran and their commits."""
    lines = [
        "| task | "
        + " | ".join(what for _, _, what in COMPARED)
        + " | seeds: GRPO, dynamic sampling, fresh, replayed | commit |",
        "|---" * (len(COMPARED) + 3) + "|",
    ]
    for task, task_name in measured_tasks(results):
        cells = [
            "; ".join(
                "{:+.1f} ± {:.1f}".format(*difference(results, task, a, b, figure))
                for figure in (AT_EQUAL_STEPS, EQUAL_TOKENS)
            )
            for a, b, _ in COMPARED
        ]
        runs = results["runs"][task]
        seeds = ", ".join(str(len(runs[variant])) for variant, _ in CONTROLS)
        ran_at = ", ".join(dict.fromkeys(commits(runs[variant]) for variant, _ in CONTROLS))
        lines.append(f"| {task_name} | " + " | ".join(cells) + f" | {seeds} | {ran_at} |")
    return "\n".join(lines)


def standing_of(results: dict, a: str, b: str, figure: str) -> dict[str, int]:
    """`tally` of A against B on `figure` over the `measured_tasks`, paired over every seed both ran."""
    return tally(difference(results, task, a, b, figure) for task, _ in measured_tasks(results))


def one_commit_verdict(results: dict) -> list[str]:
    """The phrases in which the pages say what the one-commit runs show: the recommended preset against GRPO,
    against the same refill with fresh questions, and DAPO's dynamic sampling against both."""
    tasks = f" of the {WORDS[len(measured_tasks(results))]} tasks"
    grpo, dapo, fresh_refill, ours = (variant for variant, _ in CONTROLS)

    def ratios(variant: str) -> str:
        spread = [results["summary"][task][variant][TOKENS_VS_GRPO][0] for task, _ in measured_tasks(results)]
        return f"{min(spread):.2f}-{max(spread):.2f} times GRPO's"

    def against(a: str, b: str, figure: str, tasks: str = "") -> str:
        return said(standing_of(results, a, b, figure), tasks)

    return [
        "At equal training steps it ends against plain GRPO " + against(ours, grpo, AT_EQUAL_STEPS, tasks),
        f"read at equal generated tokens (it generates {ratios(ours)}), {against(ours, grpo, EQUAL_TOKENS)}",
        "against the same refill with fresh questions in those places, at equal generated tokens, replayed "
        f"questions end {against(ours, fresh_refill, EQUAL_TOKENS)}",
        f"DAPO's dynamic sampling ends against GRPO {against(dapo, grpo, AT_EQUAL_STEPS)} at equal steps, "
        f"and {against(dapo, grpo, EQUAL_TOKENS)} at equal generated tokens (it generates {ratios(dapo)})",
        "against it at equal generated tokens the recommended preset ends "
        + against(ours, dapo, EQUAL_TOKENS),
    ]


def plot_one_commit(results: dict, path: Path) -> bool:
    """The README's picture: per measured task, val pass@1 at T = 1 against steps (top) and against generated
    tokens (bottom, the equal-token budget dashed), mean over seeds with the 95% interval as a band; False
    (nothing written) while no task has runs of every variant."""
    tasks = measured_tasks(results)
    if not tasks:
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(tasks), figsize=(3.2 * len(tasks) + 1, 6.4), squeeze=False, sharey="col")
    for column, (task, task_name) in zip(axes.T, tasks):
        budget = reading_budgets(results["runs"][task]).tokens
        for variant, name in CONTROLS:
            runs = results["runs"][task][variant]
            points = min(len(run["curve"]) for run in runs)
            # [seeds, points, (step, generated tokens, pass@1)]
            curves = np.array([run["curve"][:points] for run in runs])
            values = curves[:, :, 2]
            mean = values.mean(0)
            half = np.array([interval(list(values[:, i]))[1] for i in range(points)])
            for ax, x in zip(column, (curves[0, :, 0], curves[:, :, 1].mean(0) / 1e6)):
                (line,) = ax.plot(x, mean, marker="o", markersize=2, label=name)
                ax.fill_between(x, mean - half, mean + half, color=line.get_color(), alpha=0.12)
        column[0].set_title(task_name, fontsize=10)
        column[0].set_xlabel(BATCHES_AXIS, fontsize=8)
        column[1].axvline(budget / 1e6, color="grey", linestyle="--", linewidth=1)
        column[1].set_xlabel("generated tokens, millions (dashed: equal-token budget)", fontsize=8)
        for ax in column:
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("val pass@1, T = 1")
    axes[1, 0].set_ylabel("val pass@1, T = 1")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    fig.suptitle("All at one commit; band: 95% interval over seeds", fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))  # the legend's two rows below the charts
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main() -> None:
    results = json.loads((RESULTS / "learning_yardstick.json").read_text())
    print(table(results), gains_table(results), *verdict(results), sep="\n\n")
    one_commit = json.loads((RESULTS / f"{ONE_COMMIT}.json").read_text())
    print(
        one_commit_table(one_commit),
        comparisons_table(one_commit),
        *one_commit_verdict(one_commit),
        sep="\n\n",
    )
    plot_one_commit(one_commit, RESULTS / "headline.png")


if __name__ == "__main__":
    main()

"""The headline results of the README and the learning page, read from the one-commit runs' file.

GRPO, DAPO's dynamic sampling, and refill (dead groups' places given to other questions) with fresh questions
and with replayed ones (the recommended preset), all run at one commit by `benchmarks/learning_yardstick.py`
into benchmarks/results/dynamic_sampling.json: per task, final validation pass@1 at T = 1 with its 95%
interval over seeds, at equal steps (the last validation) and at equal generated tokens (each curve read at
the fewest tokens any run of the task generated), each variant's paired difference from GRPO and its
generated tokens over GRPO's (`table`); the paired comparisons that decide whether the gain is replay's
(`comparisons_table`); the words both pages say them in (`verdict`, and `answer`: H9's verdict in one
sentence); and a picture against steps and against generated tokens (`plot`). A task shows once its four
variants share two seeds, so the tables grow while the runs are going.

    python benchmarks/headline.py    # prints the tables and the words, draws benchmarks/results/headline.png
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from hypotheses import HYPOTHESES, ONE_COMMIT, above, decide, paired
from learning import BATCHES_AXIS, RESULTS, _pyplot, interval
from learning_yardstick import EQUAL_TOKENS, TOKENS_VS_GRPO, reading_budgets

TASKS = (("reasoning", "reasoning"), ("arithmetic", "arithmetic"), ("small_pool", "small pool"),
         ("weak_start", "weak start"))  # fmt: skip
AT_EQUAL_STEPS = "ours: val pass@1, T=1"


def commits(runs: list[dict]) -> str:
    """The distinct short commits of a variant's runs, in seed order."""
    ordered = sorted(runs, key=lambda run: run["seed"])
    return ", ".join(dict.fromkeys(run["commit"][:7] for run in ordered))


def cell(figure: dict) -> str:
    (mean, half), versus = figure["mean"], figure["vs_grpo"]
    return f"{mean:.3f} ± {half:.3f}" + (f" ({versus[0]:+.1f} ± {versus[1]:.1f})" if versus else "")


WORDS = ("none", "one", "two", "three", "four")


def tally(intervals) -> dict[str, int]:
    """How many paired intervals (mean, half-width) are above zero (lower bound above 0), below it (upper
    bound below 0), or level (holding 0)."""
    counts = {"above": 0, "level": 0, "below": 0}
    for mean, half in intervals:
        counts["above" if mean - half > 0 else "below" if mean + half < 0 else "level"] += 1
    return counts


def said(counts: dict[str, int], tasks: str = "") -> str:
    """A `tally` in words: "above on three of the four tasks, level on one and below on none"."""
    over, level, under = (WORDS[counts[key]] for key in ("above", "level", "below"))
    return f"above on {over}{tasks}, level on {level} and below on {under}"


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
HEADER = (
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


def table(results: dict) -> str:
    """The Markdown table of `results` (dynamic_sampling.json's contents): per measured task and variant, its
    seeds, final pass@1 at equal steps and at equal generated tokens with the difference from GRPO, its
    generated tokens over GRPO's at the same seeds, and the commits its runs measured."""
    lines = [HEADER, "|---" * 7 + "|"]
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


def standing(results: dict, a: str, b: str, figure: str) -> dict[str, int]:
    """`tally` of A against B on `figure` over the `measured_tasks`, paired over every seed both ran."""
    return tally(difference(results, task, a, b, figure) for task, _ in measured_tasks(results))


def verdict(results: dict) -> list[str]:
    """The phrases in which the pages say what the table shows: the recommended preset against GRPO, and
    DAPO's dynamic sampling against both (`answer` says how replayed questions end against fresh ones)."""
    tasks = f" of the {WORDS[len(measured_tasks(results))]} tasks"
    grpo, dapo, _, ours = (variant for variant, _ in CONTROLS)

    def ratios(variant: str) -> str:
        spread = [results["summary"][task][variant][TOKENS_VS_GRPO][0] for task, _ in measured_tasks(results)]
        return f"{min(spread):.2f}-{max(spread):.2f} times GRPO's"

    def against(a: str, b: str, figure: str, tasks: str = "") -> str:
        return said(standing(results, a, b, figure), tasks)

    return [
        "At equal training steps the recommended preset ends against plain GRPO "
        + against(ours, grpo, AT_EQUAL_STEPS, tasks),
        f"read at equal generated tokens (it generates {ratios(ours)}), {against(ours, grpo, EQUAL_TOKENS)}",
        f"DAPO's dynamic sampling ends against GRPO {against(dapo, grpo, AT_EQUAL_STEPS)} at equal steps, "
        f"and {against(dapo, grpo, EQUAL_TOKENS)} at equal generated tokens (it generates {ratios(dapo)})",
        "against it at equal generated tokens the recommended preset ends "
        + against(ours, dapo, EQUAL_TOKENS),
    ]


def answer(results: dict) -> str:
    """H9's verdict on the one-commit runs as the pages' one-sentence answer to whether the gain is replay's:
    refill with replayed questions against the same refill with fresh ones, at equal generated tokens."""
    (h9,) = decide({ONE_COMMIT: results["runs"]}, tuple(h for h in HYPOTHESES if h.name == "H9"))
    if h9["verdict"] == "holds":
        means = [row["intervals"][EQUAL_TOKENS][0] for row in h9["comparisons"]]
        clear = WORDS[sum(above(row) for row in h9["comparisons"])]
        return (
            "replayed questions beat fresh ones in dead groups' places by the rule written before the runs: "
            f"at equal generated tokens they end at or above fresh ones on every task and above on {clear}, "
            f"by {min(means):+.1f} to {max(means):+.1f} points (per task, mean over seeds)"
        )
    return {
        "fails": "the gain is filling dead groups, not replay: fresh questions in their places end above "
        "replayed ones on some task at equal generated tokens, and replay adds nothing measurable",
        "undecided": "whether replay adds anything to filling dead groups is undecided: at equal generated "
        "tokens replayed questions in their places end below fresh ones on no task, but not clearly above",
        "not measured": "whether replay adds anything to filling dead groups is decided once every task has "
        "its runs of replayed and of fresh questions in their places",
    }[h9["verdict"]]


def plot(results: dict, path: Path) -> bool:
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
    results = json.loads((RESULTS / f"{ONE_COMMIT}.json").read_text())
    print(table(results), comparisons_table(results), *verdict(results), answer(results), sep="\n\n")
    plot(results, RESULTS / "headline.png")


if __name__ == "__main__":
    main()

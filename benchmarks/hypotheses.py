"""The learning page's hypotheses, decided by the rule written before their runs (docs/learning.md, "Deferred
questions and a weak start: written before the runs" for H1-H4, "Ten seeds: written before the runs" for H7,
"Replay that displaces nothing, and the paper's rule for all-wrong groups: written before the runs" for H5, H6
and H8, "Replay or fuller groups? Dynamic sampling as the control: written before the runs" for H9 and H10).

Each comparison names the variant its runs were made as: H1-H4 and H7 were decided on the presets of their
time, which the results file keeps as "paper, before exact" (the paper preset before it took the official
code's settings) and "recommended, displace" (the recommended preset before H6 gave it refill); H6 decided
"recommended, refill", which is what "ExGRPO recommended" runs since.

A comparison is the difference between two variants in points, paired by seed, with its 95% Student-t
interval, on the deciding figures: the final val pass@1 at T = 1 and in-distribution avg@4 at T = 0.6 (H4:
the T = 1 curve at equal fresh questions). "A at or above B" holds when every lower bound is above -1 point,
fails when an upper bound is below 0, and is undecided otherwise; "A above B" the same with 0 for -1. A
hypothesis of several comparisons holds when all hold, fails when one fails, and is undecided otherwise; one
whose runs are missing is "not measured". A hypothesis that also asks for "above on at least one" (H6) is
undecided while every comparison holds but none is above.

    python benchmarks/hypotheses.py      # the verdicts and comparisons of benchmarks/results/*.json
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from learning import RESULTS, TASKS, interval
from learning_yardstick import EQUAL_FRESH, EQUAL_TOKENS, figures, reading_budgets

DECIDING = ("ours: val pass@1, T=1", "ID avg@4, T=0.6")
SEEDS = 5  # paired seeds a comparison needs by default (fewer: "not measured", as while its runs are going)
MARGINS = {"at or above": -1.0, "above": 0.0}  # the lower bound a comparison's intervals must clear
# The runs of H9 and H10: GRPO, the recommended preset and the two dynamic-sampling controls at one commit.
ONE_COMMIT = "dynamic_sampling"
# The recommended preset with its own and with the official code's trajectory pick, at one commit.
OFFICIAL_PICK = "official_pick"
OFFICIAL_PICK_COMPARED = "the official code's trajectory pick in the recommended preset"


@dataclass(frozen=True)
class Hypothesis:
    name: str
    claim: str
    relation: str  # a key of MARGINS
    comparisons: tuple[tuple[str, str, str], ...]  # (task, variant A, variant B)
    deciding: tuple[str, ...] = DECIDING
    seeds: int = SEEDS  # reads seeds 0 .. seeds-1: later seeds leave an earlier verdict as it was
    above_on_one: bool = False  # also: some comparison ends "above" (every deciding lower bound above 0)
    results: str = "learning_yardstick"  # the results file its runs are in (benchmarks/results/NAME.json)


HYPOTHESES = (
    Hypothesis(
        "H1", "deferring ends at or above discarding on every task", "at or above",
        tuple(
            (task, deferred, discarding)
            for task in TASKS
            for deferred, discarding in (
                ("paper, deferred", "paper, before exact"), ("recommended, deferred", "recommended, displace")
            )
        ),
    ),
    Hypothesis(
        "H2", "on the weak start, the recommended preset (then placement displace) ends above GRPO", "above",
        (("weak_start", "recommended, displace", "GRPO"),),
    ),
    Hypothesis(
        "H3", "on the weak start, the paper preset (before exact) ends at or above GRPO", "at or above",
        (("weak_start", "paper, before exact", "GRPO"),),
    ),
    Hypothesis(
        "H4",
        "at equal fresh questions trained on, the paper preset (before exact) is at or above GRPO on each "
        "task",
        "at or above", tuple((task, "paper, before exact", "GRPO") for task in TASKS), (EQUAL_FRESH,),
    ),
    Hypothesis(
        "H7",
        "at equal fresh questions trained on, the recommended preset (then placement displace) ends above "
        "GRPO on arithmetic and the small pool (10 seeds)",
        "above",
        tuple((task, "recommended, displace", "GRPO") for task in ("arithmetic", "small_pool")),
        (EQUAL_FRESH,),
        10,
    ),
    Hypothesis(
        "H5", "with join, the recommended preset ends above GRPO on the small pool (10 seeds)", "above",
        (("small_pool", "recommended, join", "GRPO"),), seeds=10,
    ),
    Hypothesis(
        "H6", "with refill, the recommended preset ends at or above GRPO on every task and above it on one "
        "(10 seeds)", "at or above", tuple((task, "ExGRPO recommended", "GRPO") for task in TASKS),
        seeds=10, above_on_one=True,
    ),
    Hypothesis(
        "H8",
        "with the paper's rule for all-wrong groups, the recommended preset (placement refill since H6) ends "
        "at or above itself with today's rule on every task",
        "at or above",
        tuple((task, "recommended, all-wrong keeps last bucket", "ExGRPO recommended") for task in TASKS),
    ),
    Hypothesis(
        "H9",
        "refill with replayed questions ends at or above refill with fresh questions on every task at equal "
        "generated tokens, and above it on one (10 seeds)",
        "at or above", tuple((task, "ExGRPO recommended", "recommended, fresh refill") for task in TASKS),
        (EQUAL_TOKENS,), seeds=10, above_on_one=True, results=ONE_COMMIT,
    ),
)  # fmt: skip


# Compared, not decided (no rule decides them): (what, task, variant A, variant B, figures, seeds, file)
REPORTED = tuple(
    ("the paper preset made exact", task, "ExGRPO paper", "paper, before exact", DECIDING, SEEDS,
     "learning_yardstick")
    for task in TASKS
) + tuple(
    ("the paper's all-wrong rule in the paper preset", task, "ExGRPO paper", "paper, all-wrong counted",
     DECIDING, SEEDS, "learning_yardstick")
    for task in TASKS
) + tuple(
    (OFFICIAL_PICK_COMPARED, task,
     "recommended, official trajectory pick", "ExGRPO recommended", DECIDING, SEEDS, OFFICIAL_PICK)
    for task in TASKS
) + tuple(  # H10, written before its runs as reported
    (f"H10: {what}", task, a, b, (EQUAL_TOKENS, DECIDING[0]), 10, ONE_COMMIT)
    for what, a, b in (
        ("DAPO's dynamic sampling vs GRPO", "GRPO, dynamic sampling", "GRPO"),
        ("the recommended preset vs DAPO's dynamic sampling", "ExGRPO recommended", "GRPO, dynamic sampling"),
    )
    for task in TASKS
)  # fmt: skip


def paired(
    runs: dict, task: str, a: str, b: str, column: str, seeds: int | None = SEEDS
) -> tuple[float, float] | None:
    """A's figure minus B's in points, paired by seed over seeds 0 .. `seeds`-1: mean and 95% half-width
    (None: fewer than `seeds` of them that both ran with the figure). `seeds=None` pairs every seed both ran,
    as a table of runs still going shows them (None: fewer than two)."""
    variants = runs.get(task, {})
    budgets = reading_budgets(variants) if variants else None
    by_seed = [{r["seed"]: figures(r, budgets) for r in variants.get(name, [])} for name in (a, b)]
    differences = [
        100 * (by_seed[0][seed][column] - by_seed[1][seed][column])
        for seed in sorted(by_seed[0].keys() & by_seed[1].keys())
        if (seeds is None or seed < seeds) and column in by_seed[0][seed] and column in by_seed[1][seed]
    ]
    return interval(differences) if len(differences) >= (seeds or 2) else None


def verdict(intervals: list[tuple[float, float]], relation: str) -> str:
    """ "holds", "fails" or "undecided" for intervals (mean, half-width) under the rule of `relation`."""
    if any(mean + half < 0 for mean, half in intervals):
        return "fails"
    if all(mean - half > MARGINS[relation] for mean, half in intervals):
        return "holds"
    return "undecided"


def decide(files: dict[str, dict], hypotheses: tuple[Hypothesis, ...] = HYPOTHESES) -> list[dict]:
    """Each hypothesis's comparisons, their intervals and verdicts, and its own verdict, from the runs of
    each results file (`files`: name -> its "runs"; a file not there has no runs)."""
    decided = []
    for hypothesis in hypotheses:
        runs = files.get(hypothesis.results, {})
        rows = []
        for task, a, b in hypothesis.comparisons:
            found = {
                column: paired(runs, task, a, b, column, hypothesis.seeds) for column in hypothesis.deciding
            }
            measured = all(value is not None for value in found.values())
            rows.append({
                "task": task, "a": a, "b": b, "intervals": found,
                "verdict": verdict(list(found.values()), hypothesis.relation) if measured else "not measured",
            })  # fmt: skip
        verdicts = {row["verdict"] for row in rows}
        overall = next(
            (v for v in ("fails", "not measured", "undecided") if v in verdicts), "holds"
        )  # one failure decides; a missing comparison keeps the rest from deciding "holds"
        if overall == "holds" and hypothesis.above_on_one and not any(above(row) for row in rows):
            overall = "undecided"
        decided.append({"name": hypothesis.name, "claim": hypothesis.claim, "comparisons": rows,
                        "verdict": overall})  # fmt: skip
    return decided


def above(row: dict) -> bool:
    """Whether a comparison's A ends above its B: every deciding lower bound above 0."""
    return verdict(list(row["intervals"].values()), "above") == "holds"


def recommended_takes_defer(decided: list[dict]) -> bool:
    """The rule for the recommended preset's default: H1 holds for it on every task, and deferring ends above
    discarding (lower bound above 0 on every deciding figure) on at least one task."""
    h1 = next(h for h in decided if h["name"] == "H1")
    own = [row for row in h1["comparisons"] if row["a"] == "recommended, deferred"]
    return all(row["verdict"] == "holds" for row in own) and any(above(row) for row in own)


def verdict_table(decided: list[dict]) -> str:
    """The verdicts as Markdown: a row per comparison, A - B in points (95% interval) per deciding figure."""
    lines = [
        "| hypothesis | task | A vs B | A - B, points (95% interval) | verdict |",
        "|---|---|---|---|---|",
    ]
    for hypothesis in decided:
        for row in hypothesis["comparisons"]:
            cells = "; ".join(
                f"{column}: " + ("—" if value is None else f"{value[0]:+.1f} ± {value[1]:.1f}")
                for column, value in row["intervals"].items()
            )
            lines.append(
                f"| {hypothesis['name']} | {row['task']} | {row['a']} vs {row['b']} | {cells} "
                f"| {row['verdict']} |"
            )
    lines += ["", "| hypothesis | claim | verdict |", "|---|---|---|"]
    lines += [f"| {h['name']} | {h['claim']} | **{h['verdict']}** |" for h in decided]
    return "\n".join(lines)


def reported_table(files: dict[str, dict], only: str | None = None) -> str:
    """`REPORTED` as Markdown: A - B in points (95% interval) per figure, and no verdict (`only`: the rows
    of that comparison alone)."""
    lines = ["| compared | task | A vs B | A - B, points (95% interval) |", "|---|---|---|---|"]
    for what, task, a, b, columns, seeds, results in REPORTED:
        if only is not None and what != only:
            continue
        runs = files.get(results, {})
        found = [(column, paired(runs, task, a, b, column, seeds)) for column in columns]
        cells = "; ".join(
            f"{column}: " + ("—" if value is None else f"{value[0]:+.1f} ± {value[1]:.1f}")
            for column, value in found
        )
        lines.append(f"| {what} | {task} | {a} vs {b} | {cells} |")
    return "\n".join(lines)


def results_files() -> dict[str, dict]:
    """The runs of each results file the hypotheses read: name -> its "runs" (a file not written yet is
    left out)."""
    paths = (RESULTS / f"{name}.json" for name in ("learning_yardstick", ONE_COMMIT, OFFICIAL_PICK))
    return {path.stem: json.loads(path.read_text())["runs"] for path in paths if path.exists()}


def main() -> None:
    files = results_files()
    decided = decide(files)
    print(verdict_table(decided))
    print("\ncompared, not decided:\n")
    print(reported_table(files))
    print("\nthe recommended preset takes displaced_questions: defer:", recommended_takes_defer(decided))


if __name__ == "__main__":
    main()

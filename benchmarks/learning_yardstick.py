"""The learning benchmark's presets measured with the paper's yardstick as well as ours.

Each run is a run of `benchmarks/learning.py` (same task, preset, seed and steps), except that one difficulty
family of the task is held out of training: "mix4_1d" (four one-digit terms, some subtracted) on the
reasoning tasks, "add_nocarry" (two-digit sums without a carry) on arithmetic. The embedded policies were
fitted on every family and start at 38% and 37% on them, so the held-out family plays the part of the
paper's out-of-distribution benchmarks: a task the base policy can do that RL never trains on. (Families the
policies never saw, such as three-digit operands or two-term subtractions, stay at 0% before and after
training: nothing to measure.) The final weights are then evaluated the way the ExGRPO paper evaluates:
sampled at T = 0.6, avg@4 (mean correctness over 4 samples of each problem) and greedy pass@1, on the
task's held-out questions (in distribution) and on 500 questions of the held-out family (out of
distribution). Our own yardstick, validation pass@1 at the training temperature (T = 1), is the run's last
curve point; the T = 1 curve is also read at the generated tokens every run of the task reached, and at the
fresh questions trained on every run reached. Differences from GRPO are paired by seed, with 95% Student-t
intervals.

    python benchmarks/learning_yardstick.py --jobs 2 --tasks reasoning --variants GRPO "ExGRPO recommended"
    python benchmarks/learning_yardstick.py --jobs 2 --resume      # all presets and tasks, 5 seeds
    python benchmarks/learning_yardstick.py --jobs 2 --resume --seeds 10 --results dynamic_sampling \\
        --variants GRPO "ExGRPO recommended" "recommended, fresh refill" "GRPO, dynamic sampling"
    python benchmarks/learning_yardstick.py --jobs 2 --resume --rerun --variants "ExGRPO paper"  # again, now

Writes benchmarks/results/learning_yardstick.json (or `--results NAME`.json): the runs, and their summary
(finished runs are kept with --resume), and learning_yardstick.png (or NAME.png): the T = 1 curves against
steps and against fresh questions trained on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from learning import (
    BATCHES_AXIS,
    PRESETS,
    RESULTS,
    ROOT,
    TASKS,
    VARIANTS,
    _pyplot,
    at_fresh_questions,
    at_tokens,
    interval,
    run,
    say_where_kept_runs_ran,
)

from exgrpo_pl.data import (
    FAMILIES,
    REASONING_FAMILIES,
    ArithmeticTask,
    EvalSet,
    PromptDataModule,
    ReasoningTask,
)

TEMPERATURE = 0.6  # the paper's evaluation temperature
SAMPLES = 4  # k of avg@k: the paper's 32 for AIME/AMC, fewer here for 500-question sets on a CPU
OOD_QUESTIONS = 500
EQUAL_FRESH = "T=1 at equal fresh questions"
EQUAL_TOKENS = "T=1 at equal generated tokens"
TOKENS_VS_GRPO = "generated tokens, x GRPO"
# Yardstick rows: (set, metric) -> its column name.
MEASURES = {
    ("id", f"avg@{SAMPLES}"): f"ID avg@{SAMPLES}, T=0.6",
    ("id", "greedy_pass@1"): "ID greedy",
    ("ood", f"avg@{SAMPLES}"): f"OOD avg@{SAMPLES}, T=0.6",
    ("ood", "greedy_pass@1"): "OOD greedy",
}


HELD_OUT = {
    "arithmetic": "add_nocarry", "reasoning": "mix4_1d", "small_pool": "mix4_1d", "weak_start": "mix4_1d"
}  # fmt: skip


def hold_out(overlay: dict, task: str) -> None:
    """Trains on the task without its `HELD_OUT` family (an `adjust` of `learning.run`)."""
    synthetic = overlay.get("data", {}).get("synthetic")
    if synthetic is None:  # arithmetic: the preset's own task
        config = yaml.safe_load((ROOT / "configs" / "grpo_baseline.yaml").read_text())
        synthetic = overlay.setdefault("data", {})["synthetic"] = config["data"]["synthetic"]
    families = FAMILIES if task == "arithmetic" else REASONING_FAMILIES
    synthetic.setdefault("init_args", {})["families"] = [f for f in families if f != HELD_OUT[task]]


def out_of_distribution(task: str):
    """500 questions of the family the task's runs never train on."""
    kind = ArithmeticTask if task == "arithmetic" else ReasoningTask
    return kind(OOD_QUESTIONS, seed=1, families=[HELD_OUT[task]])


def measure(cli, task: str) -> dict:
    """The final weights' yardstick figures: `{set: {metric: value}}` for the held-out ("id") and
    out-of-distribution ("ood") sets at T = 0.6, `SAMPLES` samples and one greedy completion per problem."""
    module, trained_on = cli.model, cli.datamodule
    module.hparams.val_temperature = TEMPERATURE
    module.hparams.val_greedy = True
    eval_sets = {
        "id": EvalSet(num_samples=SAMPLES),
        "ood": EvalSet(synthetic=out_of_distribution(task), num_samples=SAMPLES, out_of_distribution=True),
    }
    # "_instantiator" and the like are LightningCLI's bookkeeping, not options.
    options = {key: value for key, value in trained_on.hparams.items() if not key.startswith("_")}
    data = PromptDataModule(**options, synthetic=trained_on.synthetic, eval_sets=eval_sets)
    cli.trainer.validate(module, datamodule=data, verbose=False)
    rows = module.last_evaluation_table["rows"]
    return {name: rows[name] for name in eval_sets}


@dataclass(frozen=True)
class Budgets:
    """Where a task's T = 1 curves are read besides their end: at the generated tokens every run reached, and
    at the fresh questions trained on every run that recorded them reached (None: none did)."""

    tokens: float
    fresh_questions: float | None


def reading_budgets(variants: dict) -> Budgets:
    """The `Budgets` of a task's runs (every variant's)."""
    runs = [r for variant_runs in variants.values() for r in variant_runs]
    reached = [r["fresh_questions"][-1][0] for r in runs if "fresh_questions" in r]
    return Budgets(min(r["curve"][-1][1] for r in runs), min(reached) if reached else None)


def figures(run_record: dict, budgets: Budgets | None = None) -> dict[str, float]:
    """A run's yardstick figures by column, with our own (final val pass@1 at T = 1) first, and with
    `budgets` its T = 1 curve read at that many generated tokens and fresh questions trained on (runs that
    recorded them)."""
    row = {"ours: val pass@1, T=1": run_record["curve"][-1][2]}
    if budgets is not None:
        row[EQUAL_TOKENS] = at_tokens(run_record["curve"], budgets.tokens)
        if budgets.fresh_questions is not None and "fresh_questions" in run_record:
            row[EQUAL_FRESH] = at_fresh_questions(run_record, budgets.fresh_questions)
    for (name, metric), column in MEASURES.items():
        row[column] = run_record["final"][name][metric]
    return row


def summarise(runs: dict) -> dict:
    """Per task, variant and figure: `{"mean": (mean, half-width)}` over seeds, and for a preset other than
    GRPO `"vs_grpo"`: its difference from GRPO's at the same seeds, in points (None: no seed shared); and
    `TOKENS_VS_GRPO`: the tokens it generated over GRPO's at the same seeds, a ratio (None: none shared)."""
    summary: dict = {}
    for task, variants in runs.items():
        budgets = reading_budgets(variants)
        grpo = {r["seed"]: figures(r, budgets) for r in variants.get("GRPO", [])}
        grpo_tokens = {r["seed"]: r["curve"][-1][1] for r in variants.get("GRPO", [])}
        summary[task] = {}
        for name in (n for n in VARIANTS if n in variants):  # learning.py's order
            rows = [figures(r, budgets) for r in variants[name]]
            seeds = [r["seed"] for r in variants[name]]
            summary[task][name] = {"seeds": len(rows)}
            generated = [
                r["curve"][-1][1] / grpo_tokens[r["seed"]] for r in variants[name] if r["seed"] in grpo_tokens
            ]
            summary[task][name][TOKENS_VS_GRPO] = (
                interval(generated) if generated and name != "GRPO" else None
            )
            # A column every run of the variant has (equal fresh questions: runs that recorded them).
            for column in (c for c in rows[0] if all(c in row for row in rows)):
                paired = [
                    100 * (row[column] - grpo[s][column])
                    for row, s in zip(rows, seeds)
                    if s in grpo and column in grpo[s]
                ]
                summary[task][name][column] = {
                    "mean": interval([row[column] for row in rows]),
                    "vs_grpo": interval(paired) if name != "GRPO" and paired else None,
                }
    return summary


def table(summary: dict) -> str:
    """The summary as Markdown: each figure's mean ± 95% interval, and its paired difference from GRPO."""
    lines = []
    for task, variants in summary.items():
        columns = list(dict.fromkeys(c for row in variants.values() for c in row if c != "seeds"))
        if TOKENS_VS_GRPO in columns:  # the cost, last
            columns.append(columns.pop(columns.index(TOKENS_VS_GRPO)))
        lines += [f"\n{task}: mean ± 95% interval over seeds (vs GRPO, paired by seed, points)\n"]
        lines += ["| variant | seeds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
        for name, row in variants.items():
            cells = []
            for column in columns:
                if row.get(column) is None:  # runs made before the figure was recorded, or no GRPO to pair
                    cells.append("—")
                    continue
                if column == TOKENS_VS_GRPO:
                    cells.append(f"{row[column][0]:.2f} ± {row[column][1]:.2f}")
                    continue
                (mean, half), versus = row[column]["mean"], row[column]["vs_grpo"]
                cells.append(
                    f"{mean:.3f} ± {half:.3f}" + (f" ({versus[0]:+.1f} ± {versus[1]:.1f})" if versus else "")
                )
            lines.append(f"| {name} | {row['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(runs: dict, path: Path) -> None:
    """Per task, the T = 1 validation curves (mean over seeds, band: 95% interval) against batches and
    against fresh questions trained on (runs that recorded them), one PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.6 * len(runs)), squeeze=False, sharey="row")
    for row, (task, variants) in zip(axes, runs.items()):
        for name in (n for n in VARIANTS if n in variants):
            curves = variants[name]
            points = min(len(r["curve"]) for r in curves)
            values = np.array([[p[2] for p in r["curve"][:points]] for r in curves])  # [seeds, points]
            mean = values.mean(0)
            half = np.array([interval(list(values[:, i]))[1] for i in range(points)])
            axis_values = [(BATCHES_AXIS, [[p[0] for p in r["curve"][:points]] for r in curves])]
            if all("fresh_questions" in r for r in curves):
                trained = [[p[0] for p in r["fresh_questions"][:points]] for r in curves]
                axis_values.append(("fresh questions trained on", trained))
            for ax, (label, xs) in zip(row, axis_values):
                x = np.array(xs).mean(0)
                (line,) = ax.plot(x, mean, marker="o", markersize=3, label=name)
                ax.fill_between(x, mean - half, mean + half, color=line.get_color(), alpha=0.15)
                ax.set_xlabel(label)
        row[0].set_ylabel(f"{task}: val pass@1, T=1")
        row[0].legend(fontsize=7, loc="lower right")
        for ax in row:
            ax.grid(alpha=0.3)
    fig.suptitle("Validation curves (mean over seeds; band: 95% interval), one family held out of training")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def without_runs(results: dict, tasks: list[str], variants: list[str]) -> dict:
    """`results` (task -> variant -> runs) less the runs of `variants` on `tasks`."""
    return {
        task: {name: runs for name, runs in by_variant.items() if task not in tasks or name not in variants}
        for task, by_variant in results.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(PRESETS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the task's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each with 2 / jobs threads")
    parser.add_argument("--resume", action="store_true", help="keep finished runs of the results file")
    parser.add_argument(
        "--rerun", action="store_true",
        help="with --resume: drop the file's runs of --variants on --tasks first, to run them again with the "
        "code as it is now (the other runs are kept); continue a stopped rerun with --resume alone",
    )  # fmt: skip
    parser.add_argument(
        "--results", default="learning_yardstick",
        help="the results file's name in benchmarks/results/ (.json, and its .png): a set of runs made at "
        "one commit keeps a file of its own",
    )  # fmt: skip
    args = parser.parse_args()
    if args.rerun and not args.resume:
        parser.error("--rerun needs --resume: without it the results file is rewritten with this run's rows")
    path = RESULTS / f"{args.results}.json"
    results: dict = json.loads(path.read_text())["runs"] if args.resume and path.exists() else {}
    if args.rerun:
        results = without_runs(results, args.tasks, args.variants)
    say_where_kept_runs_ran(results, path.name)
    todo = [
        (task, name, seed)
        for task in args.tasks
        for seed in range(args.seeds)
        for name in args.variants
        if seed not in {r["seed"] for r in results.get(task, {}).get(name, [])}
    ]
    context = multiprocessing.get_context("spawn")
    threads = max(1, 2 // args.jobs)
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        jobs = {
            pool.submit(
                run, task, name, seed, args.steps, Path(tmp) / f"{task}-{name.replace(' ', '_')}-{seed}",
                threads, measure, hold_out,
            ): (task, name)
            for task, name, seed in todo
        }  # fmt: skip
        for done in as_completed(jobs):
            task, name = jobs[done]
            record = done.result()
            record["diagnostics"] = {k: v for k, v in record["diagnostics"].items() if k != "replayed"}
            results.setdefault(task, {}).setdefault(name, []).append(record)
            # After every run: a stopped benchmark keeps what it measured.
            path.write_text(json.dumps({"summary": summarise(results), "runs": results}))
            plot_curves(results, path.with_suffix(".png"))
            print(table(summarise(results)), flush=True)
    if not todo:
        plot_curves(results, path.with_suffix(".png"))
        print(table(summarise(results)))


if __name__ == "__main__":
    main()

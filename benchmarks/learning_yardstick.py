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
curve point. Differences from GRPO are paired by seed, with 95% Student-t intervals.

    python benchmarks/learning_yardstick.py --jobs 2 --tasks reasoning --variants GRPO "ExGRPO recommended"
    python benchmarks/learning_yardstick.py --jobs 2 --resume      # all presets and tasks, 5 seeds

Writes benchmarks/results/learning_yardstick.json: the runs, and their summary (finished runs are kept with
--resume).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml
from learning import PRESETS, RESULTS, ROOT, TASKS, VARIANTS, interval, run

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
# Yardstick rows: (set, metric) -> its column name.
MEASURES = {
    ("id", f"avg@{SAMPLES}"): f"ID avg@{SAMPLES}, T=0.6",
    ("id", "greedy_pass@1"): "ID greedy",
    ("ood", f"avg@{SAMPLES}"): f"OOD avg@{SAMPLES}, T=0.6",
    ("ood", "greedy_pass@1"): "OOD greedy",
}


HELD_OUT = {"arithmetic": "add_nocarry", "reasoning": "mix4_1d", "small_pool": "mix4_1d"}


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


def figures(run_record: dict) -> dict[str, float]:
    """A run's yardstick figures by column, with our own (final val pass@1 at T = 1) first."""
    row = {"ours: val pass@1, T=1": run_record["curve"][-1][2]}
    for (name, metric), column in MEASURES.items():
        row[column] = run_record["final"][name][metric]
    return row


def summarise(runs: dict) -> dict:
    """Per task, variant and figure: `{"mean": (mean, half-width)}` over seeds, and for a preset other than
    GRPO `"vs_grpo"`: its difference from GRPO's at the same seeds, in points (None: no seed shared)."""
    summary: dict = {}
    for task, variants in runs.items():
        grpo = {r["seed"]: figures(r) for r in variants.get("GRPO", [])}
        summary[task] = {}
        for name in (n for n in VARIANTS if n in variants):  # learning.py's order
            rows = [figures(r) for r in variants[name]]
            seeds = [r["seed"] for r in variants[name]]
            summary[task][name] = {"seeds": len(rows)}
            for column in rows[0]:
                paired = [100 * (row[column] - grpo[s][column]) for row, s in zip(rows, seeds) if s in grpo]
                summary[task][name][column] = {
                    "mean": interval([row[column] for row in rows]),
                    "vs_grpo": interval(paired) if name != "GRPO" and paired else None,
                }
    return summary


def table(summary: dict) -> str:
    """The summary as Markdown: each figure's mean ± 95% interval, and its paired difference from GRPO."""
    lines = []
    for task, variants in summary.items():
        columns = [c for c in next(iter(variants.values())) if c != "seeds"]
        lines += [f"\n{task}: mean ± 95% interval over seeds (vs GRPO, paired by seed, points)\n"]
        lines += ["| variant | seeds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
        for name, row in variants.items():
            cells = []
            for column in columns:
                (mean, half), versus = row[column]["mean"], row[column]["vs_grpo"]
                cells.append(
                    f"{mean:.3f} ± {half:.3f}" + (f" ({versus[0]:+.1f} ± {versus[1]:.1f})" if versus else "")
                )
            lines.append(f"| {name} | {row['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    args = parser.parse_args()
    path = RESULTS / "learning_yardstick.json"
    results: dict = json.loads(path.read_text())["runs"] if args.resume and path.exists() else {}
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
            print(table(summarise(results)), flush=True)
    if not todo:
        print(table(summarise(results)))


if __name__ == "__main__":
    main()

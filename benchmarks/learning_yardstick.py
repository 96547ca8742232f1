"""The learning benchmark's presets measured with the paper's yardstick as well as ours.

Each run is a run of `benchmarks/learning.py` (same task, preset, seed and steps, so the same training),
whose final weights are then evaluated the way the ExGRPO paper evaluates: sampled at T = 0.6, avg@4 (mean
correctness over 4 samples of each problem) and greedy pass@1, on the task's held-out questions (in
distribution) and on a family the policy never trained on (out of distribution: three-digit operands for
the reasoning tasks, operands up to 999 for arithmetic). Our own yardstick, validation pass@1 at the
training temperature (T = 1), is the run's last curve point. Differences from GRPO are paired by seed, with
95% Student-t intervals.

    python benchmarks/learning_yardstick.py --jobs 2 --tasks reasoning --variants GRPO "ExGRPO recommended"
    python benchmarks/learning_yardstick.py --jobs 2 --resume      # all presets and tasks, 5 seeds

Writes benchmarks/results/learning_yardstick.json (finished runs are kept with --resume).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from learning import PRESETS, RESULTS, TASKS, interval, run

from exgrpo_pl.data import REASONING_OOD_FAMILIES, ArithmeticTask, EvalSet, PromptDataModule, ReasoningTask

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


def out_of_distribution(task: str):
    """The task's out-of-distribution set: larger operands than any training question."""
    if task == "arithmetic":
        multi_digit = ["add_nocarry", "add_carry", "sub_noborrow", "sub_borrow", "sub_negative"]
        return ArithmeticTask(OOD_QUESTIONS, seed=1, max_operand=999, families=multi_digit)
    return ReasoningTask(OOD_QUESTIONS, seed=1, families=REASONING_OOD_FAMILIES)


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


def table(results: dict) -> str:
    """Per task and preset: each figure's mean ± 95% interval over seeds, and paired with GRPO (points)."""
    lines = []
    for task, variants in results.items():
        grpo = {r["seed"]: figures(r) for r in variants.get("GRPO", [])}
        columns = list(figures(next(iter(variants.values()))[0]))
        lines += [f"\n{task}: mean ± 95% interval; vs GRPO: paired by seed, points\n"]
        lines += ["| variant | seeds | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
        for name in (n for n in PRESETS if n in variants):
            runs = variants[name]
            cells = []
            for column in columns:
                mean, half = interval([figures(r)[column] for r in runs])
                cell = f"{mean:.3f} ± {half:.3f}"
                paired = [
                    100 * (figures(r)[column] - grpo[r["seed"]][column]) for r in runs if r["seed"] in grpo
                ]
                if name != "GRPO" and paired:
                    diff, diff_half = interval(paired)
                    cell += f" ({diff:+.1f} ± {diff_half:.1f})"
                cells.append(cell)
            lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--variants", nargs="+", choices=PRESETS, default=list(PRESETS))
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the task's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time, each with 2 / jobs threads")
    parser.add_argument("--resume", action="store_true", help="keep finished runs of the results file")
    args = parser.parse_args()
    path = RESULTS / "learning_yardstick.json"
    results: dict = json.loads(path.read_text()) if args.resume and path.exists() else {}
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
                threads, measure,
            ): (task, name)
            for task, name, seed in todo
        }  # fmt: skip
        for done in as_completed(jobs):
            task, name = jobs[done]
            record = done.result()
            record["diagnostics"] = {k: v for k, v in record["diagnostics"].items() if k != "replayed"}
            results.setdefault(task, {}).setdefault(name, []).append(record)
            path.write_text(
                json.dumps(results)
            )  # after every run: a stopped benchmark keeps what it measured
            print(table(results), flush=True)
    if not todo:
        print(table(results))


if __name__ == "__main__":
    main()

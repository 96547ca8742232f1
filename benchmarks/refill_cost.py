"""What filling dead groups costs in generation, side by side on one task and seed: GRPO, the recommended
preset with `placement: displace` (the paper's mix) and as shipped (`placement: refill`: replayed questions
in dead groups' places, a second generation round), its fresh twin (`dynamic_sampling: refill`, fresh
questions in those places, no replay) and DAPO's dynamic sampling on GRPO (`dynamic_sampling: dapo`, rounds
of a batch until no dead group is left, at most 10).

Each variant is the learning benchmark's of that name (benchmarks/learning.py `VARIANTS`), trained `--steps`
steps on its task (`task_overlay`), and records per step the completion tokens generated (every round), the
wall time and the process's CPU time (all threads; on a shared machine the figure the load changes least)
from one batch start to the next, its dead groups (K equal rewards) before and after their places
were filled (a placed group may be dead too: "dead groups removed" is the net gain) and the generation rounds.
Prints each variant's means and their ratios to GRPO's, over all steps and over the steps that took more
than one round, and writes benchmarks/results/refill_cost.json.

The runs of one seed generate the same tokens every time; their times do not. So the variants run in turn
`--repeats` times (GRPO, displace, ..., GRPO, displace, ...), each time ratio is taken against GRPO's run of
the same repeat, and the ratios' mean and range over the repeats are reported: a load that comes and goes
moves one repeat, not one variant.

    python benchmarks/refill_cost.py --steps 30                 # arithmetic, seed 0: about 3 min on 2 cores
    python benchmarks/refill_cost.py --task small_pool --steps 40 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml
from learning import ROOT, TASKS, task_overlay
from learning import VARIANTS as LEARNING_VARIANTS
from lightning.pytorch import Callback

from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule

RESULTS = ROOT / "benchmarks" / "results"
# name here -> the learning benchmark's variant
VARIANTS = {
    "GRPO": "GRPO",
    "displace": "recommended, displace",
    "refill": "ExGRPO recommended",
    "fresh refill": "recommended, fresh refill",
    "dynamic sampling": "GRPO, dynamic sampling",
}


class Meter(Callback):
    """Per step: (completion tokens generated, seconds from this batch start to the next, dead groups of the
    first round, dead groups trained on, generation rounds, CPU seconds of this process in that time)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float, int, int, int, float]] = []
        self._started, self._cpu, self._tokens, self._dead, self._rounds = None, 0.0, 0, (0, 0), 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self._started is not None:
            tokens = pl_module.generated_tokens - self._tokens
            self.steps.append((tokens, now - self._started, *self._dead, self._rounds, cpu - self._cpu))
        self._started, self._cpu, self._tokens = now, cpu, pl_module.generated_tokens

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = pl_module.last_step_metrics
        self._dead = (int(metrics["train/dead_groups_before"]), int(metrics["train/dead_groups_after"]))
        self._rounds = int(metrics["train/generation_rounds"])


def run(name: str, task: str, steps: int, seed: int, workdir: Path) -> list[tuple]:
    preset, change, _ = LEARNING_VARIANTS[VARIANTS[name]]
    overlay = task_overlay(task)
    overlay.setdefault("trainer", {}).update(max_steps=steps + 1, val_check_interval=None)
    workdir.mkdir(parents=True)
    (workdir / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    args = [
        "--config", str(ROOT / "configs" / f"{preset}.yaml"), "--config", str(workdir / "overlay.yaml"),
        f"--seed_everything={seed}", "--trainer.max_epochs=1000", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=0", "--trainer.logger=false",
        "--model.validate_at_start=false", f"--trainer.default_root_dir={workdir}",
    ]  # fmt: skip
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    if change is not None:
        change(cli)
    meter = Meter()
    cli.trainer.callbacks.insert(0, meter)  # first: its batch start precedes the replay callback's sampling
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return meter.steps


def time_ratios(repeats: list[list[tuple]], grpo: list[list[tuple]], column: int) -> dict:
    """Mean step time (`column` 1: wall, 5: CPU) over GRPO's in the same repeat: their mean, low and high."""
    ratios = [
        statistics.mean(s[column] for s in mine) / statistics.mean(s[column] for s in theirs)
        for mine, theirs in zip(repeats, grpo, strict=True)
    ]
    return {"mean": statistics.mean(ratios), "low": min(ratios), "high": max(ratios)}


def summary(repeats: list[list[tuple]], grpo: list[list[tuple]]) -> dict:
    steps = repeats[0]  # tokens, dead groups and rounds are the same in every repeat of one seed
    tokens = statistics.mean(s[0] for s in steps)
    further = [s for s in steps if s[4] > 1]  # steps with a further generation round
    out = {
        "tokens_per_step": tokens, "tokens_vs_grpo": tokens / statistics.mean(s[0] for s in grpo[0]),
        "seconds_per_step": statistics.median(statistics.mean(s[1] for s in run) for run in repeats),
        "seconds_vs_grpo": time_ratios(repeats, grpo, 1),
        "cpu_seconds_vs_grpo": time_ratios(repeats, grpo, 5),
        "refilling_steps": len(further), "dead_groups_per_step": statistics.mean(s[2] for s in steps),
        "dead_groups_removed_per_step": statistics.mean(s[2] - s[3] for s in steps),
        "rounds_per_step": statistics.mean(s[4] for s in steps),
    }  # fmt: skip
    if further:
        out["tokens_per_refilling_step"] = statistics.mean(s[0] for s in further)
    return out


def shown(value: float | dict) -> str:
    if isinstance(value, dict):
        return f"{value['mean']:.3g} ({value['low']:.3g}-{value['high']:.3g})"
    return f"{value:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", choices=TASKS, default="arithmetic")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="runs of every variant, in turn")
    args = parser.parse_args()
    torch.set_num_threads(2)
    measured: dict[str, list[list[tuple]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in VARIANTS:
                workdir = Path(tmp) / f"{name}-{repeat}"
                measured[name].append(run(name, args.task, args.steps, args.seed, workdir))
    result = {name: summary(repeats, measured["GRPO"]) for name, repeats in measured.items()}
    result["setup"] = {"task": args.task, "steps": args.steps, "seed": args.seed, "repeats": args.repeats}
    for name, row in result.items():
        if name != "setup":
            print(f"{name:16s} " + ", ".join(f"{key} {shown(value)}" for key, value in row.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "refill_cost.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

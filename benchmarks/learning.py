"""GRPO vs ExGRPO (paper and seed presets, and the paper's ablations) on the embedded task, at equal budgets
of generated tokens, several seeds each. Prints final and best val pass@1 (mean +- std) and writes learning
curves (val pass@1 against generated tokens) to benchmarks/results/learning.png.

    python benchmarks/learning.py --quick      # presets, 2 seeds, ~5 min on 2 CPU cores
    python benchmarks/learning.py              # presets + ablations, 3 seeds
    python benchmarks/learning.py --jobs 2     # the same, two runs at a time with one thread each

Each run is `exgrpo fit` of a shipped config, stopped when its module has generated the token budget; the
ablations change one knob of configs/exgrpo_paper.yaml. Seed s is `--seed_everything=s`, from which the
run derives its data order, replay draws, rollout and validation samples, so the seeds are independent runs
(a config that pins the data or replay seed is refused). Not a timed test: a measurement to read.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
from exgrpo_pl.callbacks import ReplayCallback
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _paper_ablation(
    replay: dict | None = None, callback: dict | None = None, module: dict | None = None, no_replay=False
):
    """A variant of the paper preset: attributes of its SelectiveReplay, ReplayCallback or module changed,
    or its ReplayCallback removed (`no_replay`: the paper's loss and advantages, without experience)."""

    def apply(cli) -> None:
        replay_callback = next(c for c in cli.trainer.callbacks if isinstance(c, ReplayCallback))
        if no_replay:
            cli.trainer.callbacks.remove(replay_callback)
        for key, value in (replay or {}).items():
            setattr(replay_callback.replay, key, value)
        for key, value in (callback or {}).items():
            setattr(replay_callback, key, value)
        for key, value in (module or {}).items():
            cli.model.hparams[key] = value

    return apply


# name -> (config, change applied to the built CLI objects)
VARIANTS = {
    "GRPO": ("grpo_baseline", None),
    "ExGRPO paper": ("exgrpo_paper", None),
    "ExGRPO seed": ("exgrpo_seed", None),
    "no question selection": ("exgrpo_paper", _paper_ablation(replay={"question_sampling": "uniform"})),
    "no trajectory selection": ("exgrpo_paper", _paper_ablation(replay={"trajectory_selection": "random"})),
    "highest entropy": ("exgrpo_paper", _paper_ablation(replay={"trajectory_selection": "highest_entropy"})),
    "no policy shaping": ("exgrpo_paper", _paper_ablation(module={"off_policy_correction": "none"})),
    "rho 0.25": ("exgrpo_paper", _paper_ablation(callback={"mix_fraction": 0.25})),
    "rho 0.75": ("exgrpo_paper", _paper_ablation(callback={"mix_fraction": 0.75})),
    # Not one of the paper's ablations: GRPO as the paper preset trains it (advantage r - mean, entropy
    # bonus), which separates what replay does from what the preset's loss settings do.
    "paper without replay": ("exgrpo_paper", _paper_ablation(no_replay=True)),
}
QUICK = ("GRPO", "ExGRPO paper", "ExGRPO seed")


class TokenBudget(Callback):
    """Stops training once the module has generated `budget` completion tokens."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.generated_tokens >= self.budget:
            trainer.should_stop = True


def run(
    name: str, seed: int, budget: int, workdir: Path, threads: int, callbacks: list[Callback] = ()
) -> list[tuple[float, float]]:
    """One training run of a variant (with extra `callbacks`); returns (generated tokens, val pass@1) at
    every validation, from 0."""
    torch.set_num_threads(threads)
    config, change = VARIANTS[name]
    args = [
        "--config", str(ROOT / "configs" / f"{config}.yaml"), f"--seed_everything={seed}",
        "--trainer.max_steps=-1", "--trainer.max_epochs=1000", "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={workdir}",
    ]  # fmt: skip
    cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
    _check_seeds_follow_the_run(cli, config)
    if change is not None:
        change(cli)
    cli.trainer.callbacks.extend([TokenBudget(budget), *callbacks])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    events = EventAccumulator(cli.trainer.logger.log_dir)
    events.Reload()
    tokens = {e.step: e.value for e in events.Scalars("train/generated_tokens")}
    curve = []
    for event in events.Scalars("val/pass@1"):
        known = [s for s in tokens if s <= event.step]
        curve.append((tokens[max(known)] if known else 0.0, event.value))
    return curve


def _check_seeds_follow_the_run(cli, config: str) -> None:
    """Refuses a config that pins the data order or the replay draws: every seed would share them."""
    pinned = []
    if cli.datamodule.hparams.seed is not None:
        pinned.append(f"data.seed={cli.datamodule.hparams.seed}")
    for callback in cli.trainer.callbacks:
        if isinstance(callback, ReplayCallback) and not callback.replay.follows_run_seed:
            pinned.append(f"the replay seed {callback.replay.seed}")
    if pinned:
        raise ValueError(
            f"configs/{config}.yaml pins {' and '.join(pinned)}: the seeds of this benchmark would share that"
            " stream. Leave it unset (None), so that it follows --seed_everything."
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the three presets, 2 seeds")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per variant (default 2 quick, 3 full)")
    parser.add_argument("--budget", type=int, default=300_000, help="generated tokens per run")
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at a time, each with 2 / jobs threads (min 1)"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, help="run only these; the other variants' results are kept"
    )
    args = parser.parse_args()
    names = args.variants or (QUICK if args.quick else tuple(VARIANTS))
    seeds = range(args.seeds or (2 if args.quick else 3))
    suffix = "_quick" if args.quick else ""
    threads = max(1, 2 // args.jobs)
    kept = {}
    if args.variants and (RESULTS / f"learning{suffix}.json").exists():
        previous = json.loads((RESULTS / f"learning{suffix}.json").read_text())
        kept = {name: entry["curves"] for name, entry in previous.items() if name not in names}
    curves: dict[str, list] = {**kept, **{name: [] for name in names}}
    # The tiny model's matmuls barely use a second thread, so two one-thread runs side by side finish
    # sooner than two two-thread runs one after the other. Results do not depend on it (seeded runs).
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        jobs = {
            pool.submit(run, name, seed, args.budget, Path(tmp) / f"{i}-{seed}", threads): name
            for i, name in enumerate(names)
            for seed in seeds
        }
        for done in as_completed(jobs):
            curves[jobs[done]].append(done.result())
            # Written after every run, so a long run that is stopped still leaves what it measured.
            report({name: runs for name, runs in curves.items() if runs}, args.budget, suffix)


def report(curves: dict[str, list], budget: int, suffix: str) -> None:
    """Print the table and write the JSON and the plot for the runs finished so far."""
    print(f"\nval pass@1 at a budget of {budget} generated tokens (mean +- std over seeds)")
    print(f"{'variant':26s} {'seeds':>5s} {'start':>7s} {'final':>15s} {'best':>15s}")
    summary = {}
    for name, runs in curves.items():
        start = statistics.mean(c[0][1] for c in runs)
        final = [c[-1][1] for c in runs]
        best = [max(v for _, v in c) for c in runs]
        summary[name] = {"start": start, "final": final, "best": best, "curves": runs}
        print(f"{name:26s} {len(runs):5d} {start:7.3f} {_fmt(final):>15s} {_fmt(best):>15s}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"learning{suffix}.json").write_text(json.dumps(summary, indent=1))
    _plot(curves, RESULTS / f"learning{suffix}.png", budget)
    print(f"wrote {RESULTS / f'learning{suffix}.png'}")


def _fmt(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} +- {std:.3f}"


def _plot(curves: dict, path: Path, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2))
    for name, runs in curves.items():
        points = min(len(c) for c in runs)
        xs = [statistics.mean(c[i][0] for c in runs) / 1000 for i in range(points)]
        ys = [statistics.mean(c[i][1] for c in runs) for i in range(points)]
        style = "-" if name in QUICK else ":"  # presets solid, ablations dotted
        ax.plot(xs, ys, marker="o", markersize=3, label=name, linestyle=style)
    ax.set_xlabel("generated tokens (thousands)")
    ax.set_ylabel("val pass@1 (mean over seeds)")
    ax.set_title(f"embedded arithmetic task, budget {budget // 1000}K generated tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the curves, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

"""Exact resume of every shipped CPU config as it is, through the CLI: `exgrpo fit --config configs/X.yaml`
with only `--trainer.max_steps` set (`max_epochs`, validation, logging and checkpoint schedule as shipped),
S steps straight against a run stopped and then resumed with `--ckpt_path last` up to S:

    mid    stopped by max_steps at step 30, in the middle of the first epoch; S = 60
    kill   SIGKILLed right after the first validation's checkpoint (step 50, mid-epoch) is written, and
           resumed from that checkpoint, the newest complete one; S = 60
    end    stopped by max_steps at the first epoch's last step E; S = max(60, E + 4) (60 with the arithmetic
           configs' 56-step epochs, 613 with the reasoning task's 609: quickstart, quickstart_reasoning)

A config whose module takes U optimizer updates per batch (`num_iterations * steps_per_generation`; the
paper preset's U = 2) counts in updates, as Lightning does: the kill comes after step 50 U (S = 50 U + 10),
the epoch's end is at U times its batches (S = E + 4 U), and every stop falls between two batches.

Besides the shipped configs, variants of one with a ReplayCallback or model option changed (`VARIANTS`):
exgrpo_displace is configs/exgrpo.yaml (whose placement is refill) with `placement: displace`, the paper's;
exgrpo_defer is that with `displaced_questions: defer`, whose training stream goes on across epochs;
exgrpo_join is configs/exgrpo.yaml with `placement: join` (which joins from the second epoch on: its "end"
case resumes there); grpo_dynamic_sampling is configs/grpo_baseline.yaml with `dynamic_sampling: dapo`, whose
steps draw further questions from the training stream.

A module of one's own (`OWN_MODULES`): own_module_kl_mix and own_module_kl_swap train the GRPO module of
examples/own_module_kl.py (it samples inline with `generate(do_sample=True)`, from the global torch
generator) with the example's ReplayCallback in mix or swap mode, through a Python `Trainer`
(`fit_own_module`, each run in a fresh process) with the checkpointing docs/reliability.md gives for one's
own script (`AtomicCheckpointIO`, `SafeModelCheckpoint`, `ckpt_path="last"`). Cases mid and end; the kill
case is the CLI's.

Compares the two runs' final checkpoints (weights, Adam state and schedule, the replay buffer and
generators, the sampling RNG, the loops with the data loader's pass and position, the retired questions,
the token counters) and the logged train/reward series, and prints the largest difference of each.

    python benchmarks/resume_exact.py                                # every config, every case
    python benchmarks/resume_exact.py --configs quickstart --cases mid kill
    python benchmarks/resume_exact.py --configs grpo_baseline --steps 12 --questions 200   # a smoke run
    python benchmarks/resume_exact.py --configs exgrpo_defer                         # the deferring variant
    python benchmarks/resume_exact.py --configs own_module_kl_mix own_module_kl_swap  # a module of one's own
    python benchmarks/resume_exact.py --configs exgrpo_join --cases end              # the placements
    python benchmarks/resume_exact.py --configs exgrpo_displace
    python benchmarks/resume_exact.py --configs grpo_dynamic_sampling               # DAPO's dynamic sampling

Writes benchmarks/results/resume_exact.json (merged with the cases already there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import torch
import yaml
from lightning.pytorch.cli import instantiate_class
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl.data import PromptDataModule

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Every shipped config that runs on the CPU (an embedded model): the hub-model presets need a GPU.
SHIPPED = sorted(
    path.stem
    for path in (ROOT / "configs").glob("*.yaml")
    if str(yaml.safe_load(path.read_text())["model"]["model_name_or_path"]).startswith("embedded:")
)
# A shipped config with ReplayCallback or model options changed: name -> (config, replay options, model ones)
VARIANTS = {
    "exgrpo_defer": ("exgrpo", {"placement": "displace", "displaced_questions": "defer"}, {}),
    "exgrpo_displace": ("exgrpo", {"placement": "displace"}, {}),
    "exgrpo_join": ("exgrpo", {"placement": "join"}, {}),
    "grpo_dynamic_sampling": ("grpo_baseline", {}, {"dynamic_sampling": "dapo"}),
}
# examples/own_module_kl.py's module through a Python Trainer: name -> the ReplayCallback's mode
OWN_MODULES = {"own_module_kl_mix": "mix", "own_module_kl_swap": "swap"}
OWN_MODULE_CASES = ["mid", "end"]
OWN_MODULE_QUESTIONS = 500  # the example's main()
CONFIGS = SHIPPED + sorted(VARIANTS) + sorted(OWN_MODULES)
CASES = ["mid", "kill", "end"]
STEPS = 60  # the mid case stops half-way


def config_path(name: str, workdir: Path, questions: int | None) -> Path:
    """configs/<name>.yaml; for a variant, a copy of its config with its ReplayCallback options; for a smoke
    run, a copy with that many questions, validating every 4 steps."""
    base, replay_options, model_options = VARIANTS.get(name, (name, {}, {}))
    path = ROOT / "configs" / f"{base}.yaml"
    if questions is None and name not in VARIANTS:
        return path
    cfg = yaml.safe_load(path.read_text())
    for callback in cfg["trainer"].get("callbacks", []) if replay_options else []:
        if callback["class_path"].endswith("ReplayCallback"):
            callback["init_args"].update(replay_options)
    cfg["model"].update(model_options)
    if questions is not None:
        cfg["data"]["synthetic"]["init_args"]["num_questions"] = questions
        cfg["trainer"]["val_check_interval"] = 4
    copy = workdir / f"{name}.yaml"
    copy.write_text(yaml.safe_dump(cfg))
    return copy


def describe(name: str, questions: int | None) -> str:
    """The config a result ran: the file, the variant's options, a smoke run's questions."""
    if questions is not None:
        return f"{name}, {questions} questions"
    base, replay_options, model_options = VARIANTS.get(name, (name, {}, {}))
    changed = ", ".join(f"{key}: {value}" for key, value in {**replay_options, **model_options}.items())
    return f"configs/{base}.yaml" + (f" with {changed}" if changed else "")


def batches_per_epoch(path: Path) -> int:
    """Training batches in one epoch of the config's data (its loader's length on one rank)."""
    data = dict(yaml.safe_load(path.read_text())["data"])
    synthetic = data.pop("synthetic", None)
    datamodule = PromptDataModule(synthetic=instantiate_class((), synthetic) if synthetic else None, **data)
    datamodule.setup("fit")
    return len(datamodule.train_dataloader())


def case_steps(config: dict, batches: int, steps: int) -> tuple[dict[str, int], dict[str, int]]:
    """Each case's stop (for "kill", the checkpoint it waits for; for "end", the epoch's length) and horizon,
    in Lightning's steps: optimizer updates, U per batch (the exact paper preset takes 2), so that every stop
    falls between two batches and the kill comes after the first validation's checkpoint."""
    updates = config["model"].get("num_iterations", 1) * config["model"].get("steps_per_generation", 1)
    epoch = batches * updates
    kill_after = config["trainer"]["val_check_interval"] * updates
    stops = {"mid": steps // 2 // updates * updates, "kill": kill_after, "end": epoch}
    horizons = {"mid": steps, "kill": max(steps, kill_after + 10), "end": max(steps, epoch + 4 * updates)}
    return stops, horizons


def fit_args(path: Path, workdir: Path, steps: int, resume: bool) -> list[str]:
    return [
        sys.executable, "-m", "exgrpo_pl.cli", "fit", "--config", str(path), f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={workdir}", "--trainer.enable_progress_bar=false",
        *(["--ckpt_path=last"] if resume else []),
    ]  # fmt: skip


def fit(path: Path, workdir: Path, steps: int, resume: bool = False) -> None:
    args = fit_args(path, workdir, steps, resume)
    with open(workdir / "fit.log", "a") as log:
        done = subprocess.run(args, cwd=workdir, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {done.returncode}); see {workdir / 'fit.log'}")


def fit_killed(path: Path, workdir: Path, steps: int, after_step: int) -> int:
    """Starts a fit of `steps` steps and SIGKILLs it as soon as the checkpoint of step `after_step` exists
    (written atomically: once its name exists it is complete), in the middle of the steps after it.
    Returns the step of the newest checkpoint the kill left."""
    with open(workdir / "fit.log", "a") as log:
        process = subprocess.Popen(
            fit_args(path, workdir, steps, False),
            cwd=workdir,
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        pattern = f"lightning_logs/*/checkpoints/*-step={after_step}.ckpt"
        while not list(workdir.glob(pattern)):
            if process.poll() is not None:
                raise RuntimeError(
                    f"the run ended (exit {process.returncode}) before step {after_step}'s save"
                )
            time.sleep(0.05)
        time.sleep(0.5)  # into the next step: nothing of it is saved
        process.send_signal(signal.SIGKILL)
        process.wait()
    saved = [p for p in workdir.glob("lightning_logs/*/checkpoints/*.ckpt") if not p.is_symlink()]
    return max(int(p.stem.rsplit("step=", 1)[1]) for p in saved)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONWARNINGS": "ignore"}


def versions(workdir: Path) -> list[Path]:
    """The run folders of `workdir`'s log folder, oldest first: Lightning's `version_N` (a Python `Trainer`'s)
    or the CLI's `<config>-s<seed>` followed by `-v1`, `-v2` for the runs after it (`exgrpo_pl.run_names`)."""

    def number(folder: Path) -> int:
        found = re.search(r"(?:^version_|-v)(\d+)$", folder.name)
        return int(found.group(1)) if found else 0

    return sorted((p for p in (workdir / "lightning_logs").iterdir() if p.is_dir()), key=number)


def series(version: Path, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(version))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)} if tag in events.Tags()["scalars"] else {}


def final_checkpoint(version: Path) -> dict:
    return torch.load(version / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")


def largest_differences(a, b, path="") -> dict[str, float]:
    """Per leaf of two checkpoints: the largest absolute difference of tensors or numbers (inf when shapes
    or keys differ, 1 when other values differ)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = {f"{path}/{k}": float("inf") for k in a.keys() ^ b.keys()}
        for key in a.keys() & b.keys():
            out.update(largest_differences(a[key], b[key], f"{path}/{key}"))
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return {path: float("inf")}
        out = {}
        for i, (x, y) in enumerate(zip(a, b)):
            out.update(largest_differences(x, y, f"{path}[{i}]"))
        return out
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return {path: float("inf")}
        if a.numel() == 0:
            return {path: 0.0}
        return {path: (a.double() - b.double()).abs().max().item()}
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return {path: abs(a - b)}
    return {path: 0.0 if a == b else 1.0}


PARTS = {
    "weights": "state_dict",
    "adam_state": "optimizer_states",
    "lr_schedule": "lr_schedulers",
    "replay_buffer_and_generators": "replay",
    "sampling_rng": "sampling_rng",
    "loops_data_pass_and_position": "loops",
    "retired_questions": "PromptDataModule",
    "token_counts": "token_counts",
}


def compare(straight: Path, resumed: Path, reward_tag: str = "train/reward") -> dict:
    """Part by part (`PARTS`), the largest difference of the two runs' final checkpoints, and the steps whose
    logged reward (`reward_tag`) differs."""
    a, b = final_checkpoint(straight), final_checkpoint(resumed)
    for checkpoint in (a, b):  # the replay state only: the checkpoint callback's state names its own folder
        checkpoint["replay"] = _replay_state(checkpoint)
    out = {}
    for name, key in PARTS.items():
        diffs = largest_differences(a.get(key), b.get(key), key)
        worst = max(diffs.items(), key=lambda kv: kv[1], default=("", 0.0))
        out[name] = {"max_abs_diff": worst[1], "where": worst[0] if worst[1] else ""}
    rewards_a, rewards_b = series(straight, reward_tag), series(resumed, reward_tag)
    steps = sorted(rewards_b)
    out["train_reward"] = {
        "resumed_logged_steps": [steps[0], steps[-1]] if steps else [],
        "steps_differing": [s for s in steps if rewards_a.get(s) != rewards_b[s]],
    }
    replay = b["replay"]
    out["buffer_rows"] = len(replay["ranks"][0]["buffer"]["question_id"]) if replay else None
    out["replayed_steps"] = replay["ranks"][0]["replayed_steps"] if replay else None
    # retired: questions the bucketer retired (rank 0), which leave the buffer; excluded_from_stream: the
    # ones the data module also leaves out of its passes (`retire_from: buffer_and_stream` only)
    out["retired"] = int(replay["ranks"][0]["buffer"]["bucketer"]["retired"].sum()) if replay else None
    out["excluded_from_stream"] = len(b.get("PromptDataModule", {}).get("excluded_question_ids", []))
    out["exact"] = (
        all(out[name]["max_abs_diff"] == 0 for name in PARTS) and not (out["train_reward"]["steps_differing"])
    )
    return out


def _replay_state(checkpoint: dict) -> dict | None:
    return next((v for k, v in checkpoint["callbacks"].items() if "ReplayCallback" in k), None)


def run_config(name: str, cases: list[str], tmp: Path, steps: int, questions: int | None) -> dict:
    """The config's cases (a module of one's own: `run_own_module`). The straight run of each horizon is
    trained once, alongside the split runs (in a process of its own: it depends on none of them)."""
    if name in OWN_MODULES:
        return run_own_module(name, cases, tmp, steps, questions)
    work = tmp / name
    work.mkdir()
    path = config_path(name, work, questions)
    stops, horizons = case_steps(yaml.safe_load(path.read_text()), batches_per_epoch(path), steps)
    horizons = {case: horizons[case] for case in cases}
    results = {}
    with ThreadPoolExecutor() as pool:
        straight = {h: pool.submit(fit_straight, path, work, h) for h in sorted(set(horizons.values()))}
        for case in cases:
            horizon, split = horizons[case], work / case
            split.mkdir()
            if case == "kill":
                stop = fit_killed(path, split, horizon, stops["kill"])
            else:
                stop = stops[case]
                fit(path, split, stop)
            fit(path, split, horizon, resume=True)
            results[f"{name}/{case}"] = r = {
                "config": describe(name, questions),
                "case": case,
                "steps": horizon,
                "steps_per_epoch": stops["end"],
                "resumed_from_step": stop,
                **compare(straight[horizon].result(), versions(split)[-1]),
            }
            report(name, r)
    return results


def report(name: str, r: dict) -> None:
    print(
        f"{name:21s} {r['case']:4s} {r['resumed_from_step']:3d} -> {r['steps']:3d}: exact={r['exact']}"
        f"  weights {r['weights']['max_abs_diff']:.3g}  adam {r['adam_state']['max_abs_diff']:.3g}"
        f"  buffer rows {r['buffer_rows']}  replayed {r['replayed_steps']}  retired {r['retired']}"
        f"  excluded from stream {r['excluded_from_stream']}"
        f"  reward steps differing {r['train_reward']['steps_differing']}",
        flush=True,
    )


def own_module_data(questions: int | None):
    from exgrpo_pl.data import ArithmeticTask

    task = ArithmeticTask(num_questions=questions or OWN_MODULE_QUESTIONS)
    return PromptDataModule(synthetic=task, batch_size=8)  # the example's main()


def fit_own_module(workdir: Path, mode: str, steps: int, questions: int | None, resume: bool) -> None:
    """examples/own_module_kl.py's GRPO and ReplayCallback as its `main()` builds them, trained to `steps`
    (resumed from `workdir`'s newest complete checkpoint), checkpointed as docs/reliability.md says for
    one's own script; run in a fresh process."""
    from lightning.pytorch import Trainer, seed_everything

    from exgrpo_pl.callbacks import ReplayCallback
    from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
    from exgrpo_pl.experience import SelectiveReplay

    spec = importlib.util.spec_from_file_location("own_module_kl", ROOT / "examples" / "own_module_kl.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    seed_everything(0)
    replay = SelectiveReplay("gaussian_lowest_entropy", replay_probability=0.5)
    callbacks = [
        ReplayCallback(mode=mode, min_buffer_size=64, replay=replay),
        SafeModelCheckpoint(save_last=True),
    ]
    trainer = Trainer(
        max_steps=steps, max_epochs=100, accelerator="cpu", limit_val_batches=0, log_every_n_steps=1,
        default_root_dir=workdir, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        plugins=[AtomicCheckpointIO()],
    )  # fmt: skip
    trainer.fit(example.GRPO(), own_module_data(questions), ckpt_path="last" if resume else None)


def run_own_module(name: str, cases: list[str], tmp: Path, steps: int, questions: int | None) -> dict:
    """The mid and end cases of a module of one's own (`fit_own_module`): the straight runs, then each split
    run stopped and resumed, every run in a process of its own."""
    work, mode = tmp / name, OWN_MODULES[name]
    work.mkdir()
    data = own_module_data(questions)
    data.setup("fit")
    epoch = len(data.train_dataloader())
    cases = [case for case in cases if case in OWN_MODULE_CASES]
    horizons = {case: max(steps, epoch + 4) if case == "end" else steps for case in cases}
    results = {}
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing carries over but the files
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        straight = {}
        for horizon in sorted(set(horizons.values())):
            straight[horizon] = work / f"straight-{horizon}"
            straight[horizon].mkdir()
            pool.submit(fit_own_module, straight[horizon], mode, horizon, questions, False).result()
        for case in cases:
            horizon, split = horizons[case], work / case
            split.mkdir()
            stop = steps // 2 if case == "mid" else epoch
            pool.submit(fit_own_module, split, mode, stop, questions, False).result()
            pool.submit(fit_own_module, split, mode, horizon, questions, True).result()
            where = "examples/own_module_kl.py's GRPO" + (f", {questions} questions" if questions else "")
            results[f"{name}/{case}"] = r = {
                "config": f"{where}, ReplayCallback(mode={mode!r}), Python Trainer",
                "case": case,
                "steps": horizon,
                "steps_per_epoch": epoch,
                "resumed_from_step": stop,
                **compare(versions(straight[horizon])[0], versions(split)[-1], reward_tag="reward"),
            }
            report(name, r)
    return results


def fit_straight(path: Path, work: Path, steps: int) -> Path:
    """The uninterrupted run of `steps` steps; returns its log version folder."""
    workdir = work / f"straight-{steps}"
    workdir.mkdir()
    fit(path, workdir, steps)
    return versions(workdir)[0]


def code_version() -> str:
    """The commit the package came from, with "+changes" when its code or the configs differ from it."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    watched = ["exgrpo_pl", "callbacks", "configs", "examples/own_module_kl.py", "benchmarks/resume_exact.py"]
    changed = subprocess.run([*git, "status", "--porcelain", *watched], capture_output=True, text=True).stdout
    return commit.strip() + ("+changes" if changed.strip() else "")


def markdown_table(results: dict) -> str:
    """The results file as docs/reliability.md shows it: per config, each case's outcome and the steps
    (stopped or killed at -> resumed up to)."""
    titles = {"mid": "mid-epoch stop", "kill": "SIGKILL", "end": "epoch end"}
    configs = sorted({key.split("/")[0] for key in results})
    lines = ["| config | " + " | ".join(titles.values()) + " | code |", "|---" * (len(titles) + 2) + "|"]
    for config in configs:
        cells, codes = [], set()
        for case in titles:
            r = results.get(f"{config}/{case}")
            if r is None:
                cells.append("not run")
                continue
            outcome = "bitwise" if r["exact"] else "differs"
            cells.append(f"{outcome} ({r['resumed_from_step']} → {r['steps']})")
            codes.add(r["code"])
        lines.append(f"| {config} | " + " | ".join(cells) + f" | {', '.join(sorted(codes))} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=CONFIGS)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES)
    parser.add_argument("--steps", type=int, default=STEPS, help="horizon of the mid and kill cases")
    parser.add_argument("--questions", type=int, help="smoke runs: this many questions, validation every 4")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            results.update(run_config(name, args.cases, Path(tmp), args.steps, args.questions))
    version = code_version()
    for result in results.values():
        result["code"] = version
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "resume_exact.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    kept = {key: value for key, value in previous.items() if "/" in key}  # this benchmark's cases
    merged = {**kept, **results}
    out.write_text(json.dumps(merged, indent=1))
    print(markdown_table(merged))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

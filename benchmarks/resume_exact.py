"""Exact resume through the CLI: `exgrpo fit` for N steps straight, against N/2 steps and then
`--ckpt_path last` up to N, on the quickstart config made small enough that questions retire, replay
starts and epochs end within the run. Compares the two runs' final checkpoints (weights, Adam state, every
rank's replay buffer and generators, the sampling RNG, the data loader's pass and position, the retired
questions) and the logged train/reward series, and prints the largest difference of each.

    python benchmarks/resume_exact.py             # swap and mix, mid-epoch and epoch-end stops, 2-rank DDP
    python benchmarks/resume_exact.py --cases swap-mid
    python benchmarks/resume_exact.py --cases mix-end --steps 12   # tiny: a smoke run

Writes benchmarks/results/resume_exact.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 30
# name -> (replay mode, devices, where the first run stops: "mid" = step 15, "end" = an epoch's last step)
CASES = {
    "swap-mid": ("swap", 1, "mid"),
    "swap-end": ("swap", 1, "end"),
    "mix-mid": ("mix", 1, "mid"),
    "mix-end": ("mix", 1, "end"),
    "swap-mid-ddp2": ("swap", 2, "mid"),
}


def config(mode: str) -> dict:
    """configs/quickstart.yaml with 150 questions (4 steps an epoch), replay from the first epoch once 32
    trajectories are stored, and questions retired after 4 solved rollouts."""
    cfg = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    cfg["trainer"].update(val_check_interval=10, log_every_n_steps=1, max_epochs=-1)
    replay = next(c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("ReplayCallback"))
    replay["init_args"].update(mode=mode, replay_start_epoch=0, min_buffer_size=32)
    replay["init_args"]["buffer"]["init_args"]["bucketer"]["init_args"]["window_size"] = 4
    cfg["data"]["synthetic"]["init_args"]["num_questions"] = 150
    return cfg


def fit(workdir: Path, cfg: dict, steps: int, devices: int, resume: bool) -> None:
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = [
        sys.executable, "-m", "exgrpo_pl.cli", "fit", "--config", str(path), f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={workdir}", "--trainer.enable_progress_bar=false",
        f"--trainer.devices={devices}", *(["--trainer.strategy=ddp"] if devices > 1 else []),
        *(["--ckpt_path=last"] if resume else []),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")


def versions(workdir: Path) -> list[Path]:
    return sorted((workdir / "lightning_logs").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))


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


def compare(straight: Path, resumed: Path) -> dict:
    a, b = final_checkpoint(straight), final_checkpoint(resumed)
    for checkpoint in (a, b):  # the replay state only: the checkpoint callback's state names its own folder
        checkpoint["replay"] = _replay_state(checkpoint)
    parts = {
        "weights": "state_dict",
        "adam_state": "optimizer_states",
        "replay_buffers_and_generators": "replay",
        "sampling_rng": "sampling_rng",
        "data_pass_and_position": "loops",
        "retired_questions": "PromptDataModule",
    }
    out = {}
    for name, key in parts.items():
        diffs = largest_differences(a.get(key), b.get(key), key)
        worst = max(diffs.items(), key=lambda kv: kv[1], default=("", 0.0))
        out[name] = {"max_abs_diff": worst[1], "where": worst[0] if worst[1] else ""}
    rewards_a, rewards_b = series(straight, "train/reward"), series(resumed, "train/reward")
    steps = sorted(rewards_b)
    out["train_reward"] = {
        "resumed_steps": [steps[0], steps[-1]] if steps else [],
        "steps_differing": [s for s in steps if rewards_a.get(s) != rewards_b[s]],
    }
    buffers = [len(rank["buffer"]["question_id"]) for rank in _replay_state(b)["ranks"]]
    out["buffer_rows_per_rank"] = buffers
    out["retired"] = len(b.get("PromptDataModule", {}).get("excluded_question_ids", []))
    out["replayed_steps"] = [rank["replayed_steps"] for rank in _replay_state(b)["ranks"]]
    out["exact"] = all(
        v["max_abs_diff"] == 0 for k, v in out.items() if isinstance(v, dict) and "max_abs_diff" in v
    )
    out["exact"] = out["exact"] and not out["train_reward"]["steps_differing"]
    return out


def _replay_state(checkpoint: dict) -> dict:
    return next(v for k, v in checkpoint["callbacks"].items() if "ReplayCallback" in k)


def epoch_end_step(version: Path, steps: int) -> int:
    """The last step of an epoch at or after the middle of the `steps`-step run, from the straight run's
    logs."""
    epochs = series(version, "epoch")
    for step in range(steps // 2, steps):
        if step in epochs and step + 1 in epochs and epochs[step + 1] > epochs[step]:
            return step + 1  # steps logged 0-based: global_step step + 1 is the epoch's end
    raise RuntimeError("no epoch ended in the second half of the run")


def run_case(name: str, tmp: Path, steps: int = STEPS) -> dict:
    mode, devices, stop = CASES[name]
    cfg = config(mode)
    straight_dir, split_dir = tmp / f"{name}-straight", tmp / f"{name}-split"
    straight_dir.mkdir()
    split_dir.mkdir()
    fit(straight_dir, cfg, steps, devices, resume=False)
    (straight,) = versions(straight_dir)
    at = steps // 2 if stop == "mid" else epoch_end_step(straight, steps)
    fit(split_dir, cfg, at, devices, resume=False)
    fit(split_dir, cfg, steps, devices, resume=True)
    resumed = versions(split_dir)[-1]
    return {"mode": mode, "devices": devices, "stopped_at": at, **compare(straight, resumed)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--steps", type=int, default=STEPS, help="steps of the straight run")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases:
            results[name] = run_case(name, Path(tmp), args.steps)
            r = results[name]
            print(
                f"{name:14s} stop {r['stopped_at']:2d}: exact={r['exact']}"
                f"  weights {r['weights']['max_abs_diff']:.3g}  adam {r['adam_state']['max_abs_diff']:.3g}"
                f"  buffers {r['buffer_rows_per_rank']}  retired {r['retired']}"
                f"  replayed {r['replayed_steps']}"
                f"  reward steps differing {r['train_reward']['steps_differing']}",
                flush=True,
            )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "resume_exact.json"
    previous = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**previous, **results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Kill trials: SIGKILL a training run during its checkpoint saves, inspect what it left, resume it.

Each trial forks a fresh run of the tiny policy from this process (the imports are paid once) that saves a
checkpoint every step, carrying a ballast tensor so that a save takes long enough to be hit. After the j-th
save has begun (j uniform in 2..5) the run is killed after a delay uniform in [0, 1.5 x the duration of its
earlier saves], so most kills land inside a write and the rest just after it (link, removal, next step).
Then the trial loads every file that has a checkpoint's name, counts temp files, and starts a second run
with `ckpt_path="last"` that must resume from the newest complete checkpoint and train 2 more steps.

Writers: "exgrpo" (AtomicCheckpointIO + SafeModelCheckpoint) or "lightning" (TorchCheckpointIO +
ModelCheckpoint, Lightning's defaults); `$TMPDIR` on the checkpoints' filesystem or on /dev/shm (tmpfs).

    python benchmarks/checkpoint_kill.py                       # 12 trials per writer and TMPDIR
    python benchmarks/checkpoint_kill.py --trials 4 --writers exgrpo

Writes benchmarks/results/checkpoint_kill.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from exgrpo_pl.checkpoints.saving import TEMP_NAME, AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.data import ARITHMETIC_ALPHABET, ArithmeticTask, PromptDataModule
from exgrpo_pl.models import build_char_tokenizer, tiny_llama_config
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import FormatReward

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
OTHER_FS = "/dev/shm"


class Ballast(Callback):
    """Adds `megabytes` of random bytes to every checkpoint (callback state), standing in for big weights."""

    def __init__(self, megabytes: int):
        self.ballast = torch.randint(0, 256, (megabytes << 20,), dtype=torch.uint8)

    def state_dict(self):
        return {"ballast": self.ballast}

    def load_state_dict(self, state_dict):
        assert state_dict["ballast"].numel() == self.ballast.numel()


class Events(Callback):
    def __init__(self, emit):
        self.emit = emit

    def on_train_start(self, trainer, pl_module):
        self.emit("START", trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self.emit("END", trainer.global_step)


def _train(job: dict, fd: int) -> None:
    """The forked run: trains with a checkpoint every step, reporting to `fd` when each write begins/ends."""
    log = os.open(os.path.join(job["root"], "runs.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ["TMPDIR"] = job["tmpdir"]
    tempfile.tempdir = None  # re-read $TMPDIR: Lightning's writer takes its temp file from there
    torch.set_num_threads(1)

    def emit(*words):
        os.write(fd, (" ".join(map(str, words)) + "\n").encode())

    exgrpo = job["writer"] == "exgrpo"

    class Reporting(AtomicCheckpointIO if exgrpo else TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            emit("BEGIN", path)
            super().save_checkpoint(checkpoint, path, storage_options)
            emit("DONE", path)

    seed_everything(0)
    module = ExGRPOModule(
        model_name_or_path=job["model"], num_generations=2, max_completion_length=3, learning_rate=1e-3,
        reward_funcs=[FormatReward(r"[0-9].*")],
    )  # fmt: skip
    checkpoint = (SafeModelCheckpoint if exgrpo else ModelCheckpoint)(
        dirpath=job["dir"], every_n_train_steps=1, save_last=job["save_last"]
    )
    trainer = Trainer(
        max_steps=job["max_steps"], accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=job["root"],
        plugins=[Reporting()], callbacks=[checkpoint, Ballast(job["ballast_mb"]), Events(emit)],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4)
    trainer.fit(module, data, ckpt_path=job["ckpt_path"])


def run(job: dict, kill_at: int | None = None, rng: random.Random | None = None, timeout: float = 300):
    """Forks `_train(job)`; with `kill_at`, SIGKILLs it after its `kill_at`-th write began.

    Returns:
        exitcode, the START/END steps it reported, and for a killed run whether the kill cut a write short.
    """
    read, write = os.pipe()
    process = multiprocessing.get_context("fork").Process(target=_train, args=(job, write), daemon=True)
    process.start()
    os.close(write)
    result, began, done, durations, pending = {"killed_mid_write": None}, 0, 0, [], b""
    deadline = time.monotonic() + timeout
    while select.select([read], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(read, 65536)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for event, value in (line.decode().split(" ", 1) for line in lines):
            if event in ("START", "END"):
                result[event.lower()] = int(value)
            elif event == "BEGIN":
                began, start = began + 1, time.monotonic()
                if began == kill_at:
                    time.sleep(rng.uniform(0, 1.5 * sum(durations) / len(durations)))
                    os.kill(process.pid, signal.SIGKILL)
            elif event == "DONE":
                done += 1
                durations.append(time.monotonic() - start)
    os.close(read)
    process.join(max(1.0, deadline - time.monotonic()))  # the pipe closes a moment before the process ends
    if process.is_alive():
        process.kill()
        process.join()
        raise TimeoutError(f"run {job} did not finish in {timeout} s; see {job['root']}/runs.log")
    process.join()
    result["exitcode"] = process.exitcode
    if kill_at is not None:  # the dead run's last line is a BEGIN: the kill cut that write short
        result["killed_mid_write"] = began > done
    return result


def inspect(directory: str) -> dict:
    """What a checkpoint directory holds: the steps of the complete checkpoints (each fully loaded), the
    files with a checkpoint's name that do not load, dangling links, and temp files."""
    found = {"complete_steps": [], "unloadable": [], "dangling": [], "temp_files": [], "temp_bytes": 0}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if TEMP_NAME.match(name):
            found["temp_files"].append(name)
            found["temp_bytes"] += os.lstat(path).st_size
        elif name.endswith(".ckpt") and not os.path.exists(path):
            found["dangling"].append(name)
        elif name.endswith(".ckpt"):
            try:
                found["complete_steps"].append(torch.load(path, weights_only=True)["global_step"])
            except Exception as err:
                found["unloadable"].append(f"{name} ({os.path.getsize(path)} bytes: {type(err).__name__})")
    return found


def trial(model_dir: str, root: str, writer: str, save_last, tmpdir: str, rng: random.Random,
          ballast_mb: int = 32) -> dict:  # fmt: skip
    """One kill and one resume in a fresh `root`; `tmpdir` is the runs' $TMPDIR (emptied first)."""
    os.makedirs(tmpdir, exist_ok=True)
    os.makedirs(root, exist_ok=True)
    directory = os.path.join(root, "checkpoints")
    job = dict(
        model=model_dir, root=root, dir=directory, writer=writer, save_last=save_last, tmpdir=tmpdir,
        ballast_mb=ballast_mb, max_steps=50, ckpt_path=None,
    )  # fmt: skip
    killed = run(job, kill_at=rng.randint(2, 5), rng=rng)
    after_kill = inspect(directory)
    orphans = [os.path.join(tmpdir, name) for name in os.listdir(tmpdir)]
    newest = max(after_kill["complete_steps"], default=0)
    resumed = run({**job, "ckpt_path": "last", "max_steps": newest + 2})
    if resumed["exitcode"] != 0:
        outcome = "crashed"
    elif resumed.get("start") == newest and resumed.get("end") == newest + 2:
        outcome = "resumed"
    else:
        outcome = f"started at step {resumed.get('start')}, not {newest}"
    other_fs = os.stat(tmpdir).st_dev != os.stat(root).st_dev
    return {
        "writer": writer, "save_last": save_last, "tmpdir_other_fs": other_fs,
        "killed_exitcode": killed["exitcode"], "killed_mid_write": killed["killed_mid_write"],
        "after_kill": after_kill, "tmpdir_orphans": len(orphans),
        "tmpdir_orphan_bytes": sum(os.path.getsize(p) for p in orphans if os.path.isfile(p)),
        "newest_complete_step": newest, "resume": outcome, "after_resume": inspect(directory),
    }  # fmt: skip


def tiny_model(path: str) -> str:
    """The 2-layer, 32-wide Llama of tests/conftest.py, saved at `path`."""
    from transformers import LlamaForCausalLM

    tokenizer = build_char_tokenizer(ARITHMETIC_ALPHABET)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=32, num_layers=1)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def summarize(trials: list[dict]) -> list[dict]:
    rows = []
    for key in sorted({(t["writer"], t["tmpdir_other_fs"]) for t in trials}):
        group = [t for t in trials if (t["writer"], t["tmpdir_other_fs"]) == key]
        kill_temps = [len(t["after_kill"]["temp_files"]) + t["tmpdir_orphans"] for t in group]
        temp_bytes = [max(t["after_kill"]["temp_bytes"], t["tmpdir_orphan_bytes"]) for t in group]
        rows.append({
            "writer": key[0], "tmpdir": "other filesystem" if key[1] else "same filesystem",
            "trials": len(group), "killed_mid_write": sum(bool(t["killed_mid_write"]) for t in group),
            "unloadable_ckpt_files": sum(len(t["after_kill"]["unloadable"]) > 0 for t in group),
            "dangling_links": sum(len(t["after_kill"]["dangling"]) > 0 for t in group),
            "temp_files_after_kill": sum(n > 0 for n in kill_temps),
            "largest_temp_mb": max(temp_bytes) / 2**20,
            "resumed": sum(t["resume"] == "resumed" for t in group),
            "temp_files_after_resume": sum(len(t["after_resume"]["temp_files"]) > 0 for t in group),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12, help="per writer and TMPDIR placement")
    parser.add_argument("--writers", nargs="+", default=["exgrpo", "lightning"])
    parser.add_argument("--ballast-mb", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="checkpoint_kill-", dir=os.environ.get("KILL_TRIALS_DIR", "/var/tmp"))
    other = tempfile.mkdtemp(prefix="checkpoint_kill-", dir=OTHER_FS)
    model = tiny_model(os.path.join(work, "model"))
    trials = []
    try:
        for writer in args.writers:
            for i in range(2 * args.trials):
                root = os.path.join(work, f"{writer}-{i}")
                tmpdir = os.path.join(other if i % 2 else work, f"tmp-{writer}-{i}")
                save_last = "link" if (i // 2) % 2 else True
                trials.append(trial(model, root, writer, save_last, tmpdir, rng, args.ballast_mb))
                shutil.rmtree(root)
                print(json.dumps({k: v for k, v in trials[-1].items() if k != "after_resume"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(other, ignore_errors=True)
    rows = summarize(trials)
    print("\n" + " | ".join(rows[0]))
    for row in rows:
        print(" | ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in row.values()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint_kill.json").write_text(json.dumps({"summary": rows, "trials": trials}, indent=1))


if __name__ == "__main__":
    main()

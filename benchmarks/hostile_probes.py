"""Replays, as a hostile user would, the failures of issue 19's items 2, 3, 5 and 6, of issue 29's items
1-4 (the probes named "29.<item> ..."), of issue 37's items 1-19 ("37.<item> ...") and of issue 54's
items 1-10 ("54.<item> ...") through `exgrpo fit` (and `exgrpo validate`, `exgrpo test` and `exgrpo export`;
the probes of the data and reward layers call what they call, in this process).

Each probe runs the quickstart (cut to a few steps) with one hostile change and prints one line: its
outcome ("clear error": the run stops with a message that names the file, option or function; "clear
warning": it runs and a warning names it; "works": the run does the right thing; "detectable": what can still
happen is told apart by the files themselves; "FAILED" otherwise), the seconds it took and the evidence,
and records the commit it ran at. Writes results/hostile_probes.json and prints its outcomes as
docs/reliability.md shows them. The full-disk probes mount a small tmpfs and need root; without it they say
so. The seconds in the results file add up to about half an hour on 2 shared cores.

    python benchmarks/hostile_probes.py              # all probes
    python benchmarks/hostile_probes.py --only url   # the probes whose name contains "url"
    python benchmarks/hostile_probes.py --only 29.   # issue 29's probes
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

# The tests' helpers: tests/checkpoints' modules import tests/conftest.py by name.
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / part) for part in ("checkpoints", "")]
from test_checkpoint_integrity import WEIGHT, ZERO2, deepspeed_folder, flip_exponent_bit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
QUICK = [
    "--config", str(ROOT / "configs" / "quickstart.yaml"), "--model.validate_at_start=false",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
]  # fmt: skip
# Reward functions the probes name by class_path; the run finds them through PYTHONPATH.
PROBE_REWARDS = '''
import re

class Backtracking:
    """Exponential backtracking in `re`, which keeps the GIL for the whole match: never returns."""

    def __call__(self, prompts, completions, **columns):
        return [0.0 if re.fullmatch(r"(a+)+$", "a" * 60 + "!") else 1.0 for _ in completions]


class FailsOnThirdCall:
    """Raises in the third training step, as a reward function meeting a row it cannot handle would."""

    in_process = True

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, completions, answer, **columns):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the reward function met a row it cannot handle")
        return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]
'''


class WritesMarker:
    """Unpickling this creates the file `marker`: a harmless stand-in for code in a malicious checkpoint."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def exgrpo(
    workdir: Path, *args: str, timeout: float = 600, signal_when: tuple | None = None, subcommand: str = "fit"
) -> dict:
    """Runs `exgrpo fit` (or `subcommand`) with `args` in `workdir`; `signal_when=(ready, signum)` sends it
    `signum` 2 s after `ready(process)` first returns True."""
    env = {**os.environ, "PYTHONPATH": f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["TMPDIR"] = str(workdir / "tmp")
    (workdir / "tmp").mkdir(exist_ok=True)
    command = [sys.executable, "-m", "exgrpo_pl.cli", subcommand, *QUICK, *args]
    started = time.monotonic()
    process = subprocess.Popen(
        command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    sent: dict[str, float] = {}
    if signal_when is not None:
        threading.Thread(target=signal_once, args=(process, *signal_when, sent), daemon=True).start()
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    ended = time.monotonic()
    return {
        "pid": process.pid, "code": process.returncode, "seconds": ended - started,
        "output": output.decode(errors="replace"),
        "after_signal": ended - sent["at"] if "at" in sent else None,
    }  # fmt: skip


def signal_once(process: subprocess.Popen, ready: Callable, signum: int, sent: dict) -> None:
    while process.poll() is None and not ready(process):
        time.sleep(0.5)
    time.sleep(2.0)
    if process.poll() is None:
        sent["at"] = time.monotonic()
        process.send_signal(signum)


def last_error(output: str) -> str:
    """The last line that reads like an exception or a warning, for the evidence column."""
    lines = [
        line.strip()
        for line in output.splitlines()
        if re.search(r"(Error|Exception|Warning|Terminated)\b", line)
    ]
    return lines[-1][:300] if lines else output.strip().splitlines()[-1][:300] if output.strip() else ""


def verdict(ok: bool, kind: str) -> str:
    return kind if ok else "FAILED"


# ---------------------------------------------------------------------------------------------- item 2
@contextlib.contextmanager
def serving(directory: Path):
    """An HTTP server on 127.0.0.1 for the files of `directory`; yields its base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def payload(workdir: Path) -> tuple[Path, Path]:
    marker = workdir / "payload-ran"
    torch.save({"state_dict": {}, "global_step": 1, "evil": WritesMarker(str(marker))}, workdir / "evil.ckpt")
    return workdir / "evil.ckpt", marker


def probe_url_payload(workdir: Path) -> tuple[str, str, dict]:
    path, marker = payload(workdir)
    with serving(workdir) as url:
        run = exgrpo(workdir, "--trainer.max_steps=1", f"--ckpt_path={url}/{path.name}")
    ok = run["code"] != 0 and not marker.exists() and "UnsafeCheckpointError" in run["output"]
    return verdict(ok, "clear error"), f"payload ran: {marker.exists()}; {last_error(run['output'])}", run


def probe_local_payload(workdir: Path) -> tuple[str, str, dict]:
    path, marker = payload(workdir)
    run = exgrpo(workdir, "--trainer.max_steps=1", f"--ckpt_path={path}")
    ok = run["code"] != 0 and not marker.exists() and str(path) in run["output"]
    return verdict(ok, "clear error"), f"payload ran: {marker.exists()}; {last_error(run['output'])}", run


# ---------------------------------------------------------------------------------------------- item 3
BACKTRACKING = "--model.reward_funcs=[{class_path: probe_rewards.Backtracking}]"
FAILING = "--model.reward_funcs=[{class_path: probe_rewards.FailsOnThirdCall}]"


def write_rewards(workdir: Path) -> None:
    (workdir / "probe_rewards.py").write_text(PROBE_REWARDS)


def worker_processes(parent: int) -> set[int]:
    """The pids of the running reward worker processes that `parent` started (its pid ends their command)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            command = (entry / "cmdline").read_bytes().split(b"\0")
            ours = str(parent).encode() in command  # the worker's last argument is its parent's pid
            if entry.name.isdigit() and ours and any(part.endswith(b"_worker_main.py") for part in command):
                pids.add(int(entry.name))
    return pids


def probe_gil_reward_limit(workdir: Path) -> tuple[str, str, dict]:
    write_rewards(workdir)
    run = exgrpo(
        workdir, "--trainer.max_steps=2", BACKTRACKING, "--model.reward_timeout_seconds=2", timeout=300,
    )  # fmt: skip
    left = worker_processes(run["pid"])
    ok = run["code"] != 0 and "did not return within 2 s" in run["output"] and not left
    detail = f"stopped after {run['seconds']:.0f} s (limit 2 s), workers left: {len(left)}"
    detail += f"; {last_error(run['output'])}"
    return verdict(ok, "clear error"), detail, run


def probe_signal_during_reward(workdir: Path, signum: int) -> tuple[str, str, dict]:
    write_rewards(workdir)
    # The default limit (600 s); the signal comes 2 s after the reward's worker process has started.
    run = exgrpo(
        workdir, "--trainer.max_steps=2", BACKTRACKING,
        signal_when=(lambda process: bool(worker_processes(process.pid)), signum), timeout=300,
    )  # fmt: skip
    left = worker_processes(run["pid"])
    in_reward = "Terminated" in run["output"] or "KeyboardInterrupt" in run["output"]
    after = run["after_signal"]
    ok = run["code"] != 0 and in_reward and not left and after is not None
    name = signal.Signals(signum).name
    detail = f"{name} 2 s into the reward: exited {after or 0:.1f} s later, code {run['code']}"
    detail += f", workers left: {len(left)}"
    return verdict(ok, "works"), f"{detail}; {last_error(run['output'])}", run


# ---------------------------------------------------------------------------------------------- item 5
@contextlib.contextmanager
def small_disk(workdir: Path, size: str):
    """A tmpfs of `size` mounted at workdir/disk (root only); yields its path or None."""
    disk = workdir / "disk"
    disk.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]).returncode
    ):
        yield None
        return
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)])


def probe_full_disk(workdir: Path) -> tuple[str, str, dict]:
    # A quickstart checkpoint is 4.1 MB: the first save (step 2) fits in 6 MB, the second (step 4) does not.
    with small_disk(workdir, "6M") as disk:
        if disk is None:
            return "not run", "mounting a tmpfs needs root", {}
        run = exgrpo(
            workdir, "--trainer.max_steps=6", f"--trainer.default_root_dir={disk}",
            "--trainer.callbacks+=exgrpo_pl.checkpoints.SafeModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_last=link",
        )  # fmt: skip
        saved = sorted(disk.glob("lightning_logs/*/checkpoints/*.ckpt"))
        names = [p.name for p in saved]
        older = [p for p in saved if p.name == "epoch=0-step=2.ckpt"]
        loads = bool(older) and torch.load(older[0], weights_only=True)["global_step"] == 2
    ok = (
        run["code"] != 0
        and "No space left to write" in run["output"]
        and "step=4.ckpt" in run["output"]
        and loads
    )
    return (
        verdict(ok, "clear error"),
        f"left {names}, step 2 loads: {loads}; {last_error(run['output'])}",
        run,
    )


def probe_exception_in_training(workdir: Path) -> tuple[str, str, dict]:
    write_rewards(workdir)
    run = exgrpo(
        workdir, "--trainer.max_steps=6", FAILING,
        "--trainer.callbacks+=exgrpo_pl.checkpoints.SafeModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_last=link",
        f"--trainer.default_root_dir={workdir / 'run'}",
    )  # fmt: skip
    saved = sorted(p.name for p in (workdir / "run").glob("lightning_logs/*/checkpoints/*.ckpt"))
    said = re.search(r"no checkpoint is saved on the way out.*?step=2.ckpt \(step 2\)", run["output"])
    ok = run["code"] != 0 and said is not None and saved == ["epoch=0-step=2.ckpt", "last.ckpt"]
    return verdict(ok, "clear error"), f"left {saved}; says why: {said is not None}", run


# ---------------------------------------------------------------------------------------------- item 6
def probe_option(*args: str, expect: str) -> Callable[[Path], tuple[str, str, dict]]:
    def probe(workdir: Path) -> tuple[str, str, dict]:
        run = exgrpo(workdir, "--trainer.max_steps=2", *args)
        ok = run["code"] != 0 and re.search(expect, run["output"]) is not None
        return verdict(ok, "clear error"), last_error(run["output"]), run

    return probe


def probe_incomplete_ckpt(content: bytes) -> Callable[[Path], tuple[str, str, dict]]:
    def probe(workdir: Path) -> tuple[str, str, dict]:
        (workdir / "cut.ckpt").write_bytes(content)
        run = exgrpo(workdir, "--trainer.max_steps=1", f"--ckpt_path={workdir / 'cut.ckpt'}")
        ok = run["code"] != 0 and "cut.ckpt: not a complete checkpoint" in run["output"]
        return verdict(ok, "clear error"), last_error(run["output"]), run

    return probe


def probe_checkpoint_name(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo(workdir, "--trainer.max_steps=15", f"--trainer.default_root_dir={workdir / 'run'}")
    names = sorted(p.name for p in (workdir / "run").glob("lightning_logs/*/checkpoints/*.ckpt"))
    # 1,800 training questions in batches of 32: step 15 is in epoch 0.
    return verdict(run["code"] == 0 and "epoch=0-step=15.ckpt" in names, "works"), f"saved {names}", run


def probe_inductor_dir(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo(workdir, "--trainer.max_steps=1")
    left = sorted(p.name for p in (workdir / "tmp").iterdir())
    # torch makes its compile cache directory on `import torch._dynamo` (Lightning imports it); it is where
    # the static engine's compiled kernels are kept from run to run, so it stays (TORCHINDUCTOR_CACHE_DIR
    # moves it). Anything else left there is ours.
    ours = [name for name in left if not name.startswith("torchinductor_")]
    outcome = "works" if run["code"] == 0 and not ours else "not fixed"
    return outcome, f"left in $TMPDIR: {left} (torchinductor_*: torch's compile cache, kept by design)", run


def full_checkpoint(workdir: Path) -> Path:
    """A real quickstart checkpoint (one step)."""
    run = exgrpo(workdir, "--trainer.max_steps=1", f"--trainer.default_root_dir={workdir / 'seed'}")
    assert run["code"] == 0, run["output"][-2000:]
    return next((workdir / "seed").glob("lightning_logs/*/checkpoints/epoch=*.ckpt"))


def probe_truncated_ckpt(workdir: Path) -> tuple[str, str, dict]:
    data = full_checkpoint(workdir).read_bytes()
    return probe_incomplete_ckpt(data[: len(data) // 2])(workdir)


# ------------------------------------------------------------------------------------------ issue 29
def replay_callback(**options: object) -> str:
    """The quickstart's callbacks replaced by one ReplayCallback with `options`."""
    given = ", ".join(f"{name}: {value}" for name, value in options.items())
    return f"--trainer.callbacks=[{{class_path: exgrpo_pl.callbacks.ReplayCallback, init_args: {{{given}}}}}]"


def probe_flipped_ckpt_path(workdir: Path) -> tuple[str, str, dict]:
    path = full_checkpoint(workdir)
    record = flip_exponent_bit(path)
    run = exgrpo(workdir, "--trainer.max_steps=2", f"--ckpt_path={path}")
    said = f"{path.name}: not a complete, intact checkpoint (record '{record}' fails its CRC-32 check"
    return verdict(run["code"] != 0 and said in run["output"], "clear error"), last_error(run["output"]), run


def probe_flipped_last(workdir: Path) -> tuple[str, str, dict]:
    every_step = [
        f"--trainer.default_root_dir={workdir / 'run'}",
        "--trainer.callbacks+=exgrpo_pl.checkpoints.SafeModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=1", "--trainer.callbacks.save_top_k=-1",
    ]  # fmt: skip
    first = exgrpo(workdir, "--trainer.max_steps=2", *every_step)
    assert first["code"] == 0, first["output"][-2000:]
    newest = next((workdir / "run").glob("lightning_logs/*/checkpoints/epoch=0-step=2.ckpt"))
    flip_exponent_bit(newest)
    run = exgrpo(workdir, "--trainer.max_steps=3", "--ckpt_path=last", *every_step)
    warned = re.search(
        r"skipping incomplete or corrupt \S*step=2\.ckpt \(record .*; using \S*step=1\.ckpt", run["output"]
    )
    ok = run["code"] == 0 and warned is not None
    return verdict(ok, "works"), warned.group(0)[:200] if warned else last_error(run["output"]), run


def probe_infinite_weight(workdir: Path) -> tuple[str, str, dict]:
    checkpoint = torch.load(full_checkpoint(workdir), weights_only=True)
    checkpoint["state_dict"][WEIGHT][0, 0] = float("inf")
    torch.save(checkpoint, workdir / "inf.ckpt")
    run = exgrpo(workdir, "--trainer.max_steps=3", f"--ckpt_path={workdir / 'inf.ckpt'}")
    said = f"NonFiniteWeightsError: The weights restored from {workdir / 'inf.ckpt'} hold NaN or inf"
    return verdict(run["code"] != 0 and said in run["output"], "clear error"), last_error(run["output"]), run


def probe_unreachable_minimum(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo(workdir, "--trainer.max_steps=2", replay_callback(mode="mix", min_buffer_size=5000))
    start = "min_buffer_size=5000 trajectories per rank, but this run can store at most 512" in run["output"]
    end = "replay was active, but no step of this run replayed" in run["output"]
    detail = f"warned at the start: {start}, at the end: {end}"
    return verdict(run["code"] == 0 and start and end, "clear warning"), detail, run


def probe_unreadable_text(workdir: Path) -> tuple[str, str, dict]:
    rows = [{"prompt": "12+3=", "answer": "15"}, {"prompt": "What is 2 + 3?", "answer": "5"}]
    (workdir / "val.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = exgrpo(workdir, "--trainer.max_steps=1", f"--data.val_path={workdir / 'val.jsonl'}")
    said = f"{workdir / 'val.jsonl'}: line 2: column 'prompt' of question_id="
    ok = run["code"] != 0 and said in run["output"] and "cannot encode: ' ', '?', 'W'" in run["output"]
    return verdict(ok, "clear error"), last_error(run["output"]), run


def probe_changed_replay_options(workdir: Path) -> tuple[str, str, dict]:
    path = full_checkpoint(workdir)
    run = exgrpo(workdir, "--trainer.max_steps=2", f"--ckpt_path={path}", replay_callback(mode="swap"))
    listed = re.search(r"(\d+) ReplayCallback option\(s\) differ", run["output"])
    ok = run["code"] == 0 and listed is not None and "mode: 'mix' in the checkpoint, 'swap'" in run["output"]
    return verdict(ok, "clear warning"), listed.group(0) if listed else last_error(run["output"]), run


def probe_callback_option_alone(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo(workdir, "--trainer.max_steps=1", replay_callback(mix_fraction=1.5))
    last = run["output"].strip().splitlines()[-1] if run["output"].strip() else ""
    ok = run["code"] != 0 and last == "ValueError: ReplayCallback mix_fraction=1.5: must be in (0, 1]"
    return verdict(ok, "clear error"), f"last line: {last}; {len(run['output'])} characters in all", run


# ------------------------------------------------------------------------------------------ issue 37
def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def sums(count: int, **extra: object) -> list[dict]:
    """`count` questions the quickstart's tokenizer reads ("12+7="), with `extra` columns."""
    return [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7), **extra} for i in range(count)]


def exgrpo_validate(workdir: Path, *args: str) -> dict:
    """`exgrpo validate` of the quickstart's untrained policy with `args`, no plain validation split."""
    command = [sys.executable, "-m", "exgrpo_pl.cli", "validate", *QUICK, "--data.val_fraction=0", *args]
    started = time.monotonic()
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    return {"code": done.returncode, "seconds": time.monotonic() - started, "output": output}


def in_process(
    check: Callable[[Path], tuple[bool, str]], kind: str
) -> Callable[[Path], tuple[str, str, dict]]:
    """A probe of the data or reward layer, called as `exgrpo fit` would call it, in this process."""

    def probe(workdir: Path) -> tuple[str, str, dict]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                ok, detail = check(workdir)
            except Exception as err:  # noqa: BLE001 - the probe reports what it met
                ok, detail = (
                    kind == "clear error" and check.__doc__ in str(err),
                    f"{type(err).__name__}: {err}",
                )
        said = "; ".join(str(w.message)[:200] for w in caught)
        return verdict(ok, kind), detail[:300], {"output": f"{detail}\n{said}"}

    return probe


def probe_completions_column(workdir: Path) -> tuple[str, str, dict]:
    path = write_jsonl(workdir / "train.jsonl", sums(64, completions="13"))
    run = exgrpo(workdir, "--trainer.max_steps=2", f"--data.train_path={path}")
    said = "line 1: column 'completions' has the name of an argument reward functions get from the trainer"
    return verdict(run["code"] != 0 and said in run["output"], "clear error"), last_error(run["output"]), run


def one_domain_set(workdir: Path) -> str:
    path = write_jsonl(workdir / "aime.jsonl", sums(6, source="aime"))
    return f"--data.eval_sets={{aime: {{path: {path}, domain_column: source, average_by_domain: true}}}}"


def probe_one_domain_average(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo_validate(workdir, one_domain_set(workdir))
    found = re.search(r"\| average \(all\) \| [\d.]+ \|", run["output"])
    return verdict(run["code"] == 0 and found is not None, "works"), found.group(0) if found else "", run


def probe_problem_in_two_domains(workdir: Path) -> tuple[str, str, dict]:
    rows = sums(3, source="aime") + sums(1, source="amc")  # the first problem is in both
    path = write_jsonl(workdir / "mixed.jsonl", rows)
    run = exgrpo_validate(workdir, f"--data.eval_sets={{mixed: {{path: {path}, domain_column: source}}}}")
    warned = "1 problem(s) appear under several domains" in run["output"]
    kept = re.search(r"\| mixed/amc \|.*\| 1 \|", run["output"]) is not None  # its one problem kept
    return (
        verdict(run["code"] == 0 and warned and kept, "clear warning"),
        f"warned: {warned}, amc kept: {kept}",
        run,
    )


def probe_start_with_named_sets_only(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo(
        workdir, "--trainer.max_steps=1", "--model.validate_at_start=true", "--data.val_fraction=0",
        one_domain_set(workdir), f"--trainer.default_root_dir={workdir / 'run'}",
    )  # fmt: skip
    measured = re.search(r"val/aime/score before training: [\d.]+", run["output"])
    nan = "val/pass@1 before training: nan" in run["output"]
    ok = run["code"] == 0 and measured is not None and not nan
    return verdict(ok, "works"), measured.group(0) if measured else last_error(run["output"]), run


def probe_maj_by_source(workdir: Path) -> tuple[str, str, dict]:
    path = write_jsonl(workdir / "set.jsonl", sums(4, source="a"))
    routed = "{a: {class_path: exgrpo_pl.rewards.ReasoningReward}}"
    reward = f"{{class_path: exgrpo_pl.rewards.RewardBySource, init_args: {{rewards: {routed}}}}}"
    run = exgrpo_validate(
        workdir, f"--model.reward_funcs=[{reward}]", "--model.val_num_generations=4",
        f"--data.eval_sets={{s: {{path: {path}, domain_column: source, num_samples: 4}}}}",
    )  # fmt: skip
    header = next((line for line in run["output"].splitlines() if line.startswith("| set |")), "")
    return verdict(run["code"] == 0 and "maj@4" in header, "works"), header, run


def check_json_messages(workdir: Path) -> tuple[bool, str]:
    from exgrpo_pl.data import PromptDataModule

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1="}]
    path = write_jsonl(workdir / "train.jsonl", [{"prompt": json.dumps(messages), "answer": "2"}])
    data = PromptDataModule(train_path=path, val_fraction=0, drop_system_prompt=True, batch_size=1)
    data.setup("fit")
    prompt = data.train_rows[0]["prompt"]
    return prompt == messages[1:], f"prompt: {prompt!r}"


def check_float_answers(workdir: Path) -> tuple[bool, str]:
    """column 'answer' is nan"""
    from exgrpo_pl.data import load_rows

    rows = load_rows(write_jsonl(workdir / "a.jsonl", [{"prompt": "36+1=", "answer": 37.0}]))
    (workdir / "b.json").write_text('[{"prompt": "1+1=", "answer": NaN}]')
    if rows[0]["answer"] != "37":
        return False, f"37.0 read as {rows[0]['answer']!r}"
    load_rows(workdir / "b.json")
    return False, "NaN accepted"


def check_ids_ignore_none_keys(workdir: Path) -> tuple[bool, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from exgrpo_pl.data import load_rows

    rows = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(2)]
    pq.write_table(pa.Table.from_pylist(rows), workdir / "a.parquet")
    rows[1]["prompt"][0]["name"] = "alice"
    pq.write_table(pa.Table.from_pylist(rows), workdir / "b.parquet")
    before, after = load_rows(workdir / "a.parquet"), load_rows(workdir / "b.parquet")
    same = before[0]["id"] == after[0]["id"] and after[0]["prompt"] == before[0]["prompt"]
    return same, f"first row's id {before[0]['id']} -> {after[0]['id']}, prompt {after[0]['prompt']!r}"


def check_integer_source(workdir: Path) -> tuple[bool, str]:
    from exgrpo_pl.data import load_rows
    from exgrpo_pl.rewards import RewardBySource

    path = write_jsonl(workdir / "a.jsonl", [{"prompt": "1+1=", "answer": "2", "data_source": 7}])
    (row,) = load_rows(path, domain_column="data_source")
    router = RewardBySource(
        {7: lambda prompts, completions, **c: [1.0]}, default=lambda prompts, completions, **c: [0.0]
    )
    scores = router([row["prompt"]], ["2"], domain=[row["domain"]])
    return scores == [
        1.0
    ], f"source {row['domain']!r} scored {scores} (1.0: its own reward, 0.0: the default)"


def check_multiple_choice_pronoun(workdir: Path) -> tuple[bool, str]:
    from exgrpo_pl.rewards import MultipleChoiceReward

    chosen = MultipleChoiceReward(boxed_only=False).extract_answer("Answer: I think it is B")
    return chosen is None, f"'Answer: I think it is B' chooses {chosen!r}"


def probe_resume_on_other_file(workdir: Path) -> tuple[str, str, dict]:
    root = f"--trainer.default_root_dir={workdir / 'run'}"
    first = exgrpo(
        workdir,
        "--trainer.max_steps=2",
        f"--data.train_path={write_jsonl(workdir / 'a.jsonl', sums(96))}",
        root,
    )
    assert first["code"] == 0, first["output"][-2000:]
    path = next((workdir / "run").glob("lightning_logs/*/checkpoints/*.ckpt"))
    other = write_jsonl(workdir / "b.jsonl", sums(48))
    run = exgrpo(workdir, "--trainer.max_steps=4", f"--data.train_path={other}", f"--ckpt_path={path}", root)
    said = "b.jsonl' are not those the checkpoint was trained on (94 then, 47 now)"
    return verdict(run["code"] != 0 and said in run["output"], "clear error"), last_error(run["output"]), run


def probe_plain_state_dict(workdir: Path) -> tuple[str, str, dict]:
    weights = workdir / "weights.pt"  # what `torch.save(model.state_dict(), ...)` writes
    torch.save(torch.load(full_checkpoint(workdir), weights_only=True)["state_dict"], weights)
    run = exgrpo(workdir, "--trainer.max_steps=1", f"--ckpt_path={weights}")
    said = re.search(
        r"NotALightningCheckpointError: .*weights\.pt: a plain state_dict \(\d+ tensors", run["output"]
    )
    built = (workdir / "lightning_logs").exists()
    ok = run["code"] != 0 and said is not None and "model_name_or_path" in run["output"] and not built
    return verdict(ok, "clear error"), f"built a run: {built}; {last_error(run['output'])}", run


def probe_deepspeed_folder_without_model_states(workdir: Path) -> tuple[str, str, dict]:
    # A ZeRO-2 folder's layout, marked complete, that lost the one file DeepSpeed loads the module from.
    folder = workdir / "ds.ckpt"
    deepspeed_folder(folder, [name for name in ZERO2 if name != "mp_rank_00_model_states.pt"])
    run = exgrpo(workdir, "--trainer.max_steps=1", f"--ckpt_path={folder}")
    said = "ds.ckpt: not a complete, intact checkpoint (checkpoint/mp_rank_00_model_states.pt is missing"
    return verdict(run["code"] != 0 and said in run["output"], "clear error"), last_error(run["output"]), run


def probe_huge_evaluation_set(workdir: Path) -> tuple[str, str, dict]:
    path = write_jsonl(workdir / "set.jsonl", sums(4))
    run = exgrpo_validate(workdir, f"--data.eval_sets={{huge: {{path: {path}, num_samples: 1000000}}}}")
    ok = run["code"] != 0 and "eval_sets['huge'] num_samples=1000000: " in run["output"]
    return verdict(ok, "clear error"), f"after {run['seconds']:.0f} s: {last_error(run['output'])}", run


def probe_old_paths_in_a_cfg_file(workdir: Path) -> tuple[str, str, dict]:
    config = workdir / "old.cfg"  # YAML, under a name that is not .yaml/.yml/.json
    config.write_text("trainer:\n  plugins: exgrpo_pl.checkpointing.AtomicCheckpointIO\n")
    run = exgrpo(workdir, "--trainer.max_steps=1", "--config", str(config))
    said = f"{config}, line 2: exgrpo_pl.checkpointing.AtomicCheckpointIO: exgrpo_pl.checkpointing moved to"
    ok = run["code"] == 0 and said in run["output"]
    detail = f"named file and line: {said in run['output']}; {len(run['output'])} characters of output"
    return verdict(ok, "clear warning"), detail, run


def probe_setup_errors_alone(workdir: Path) -> tuple[str, str, dict]:
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2="}]
    data = exgrpo(
        workdir, "--trainer.max_steps=1", f"--data.train_path={write_jsonl(workdir / 'a.jsonl', rows)}"
    )
    checkpoint = torch.load(full_checkpoint(workdir), weights_only=True)
    checkpoint["state_dict"][WEIGHT][0, 0] = float("inf")
    torch.save(checkpoint, workdir / "inf.ckpt")
    weights = exgrpo(workdir, "--trainer.max_steps=2", f"--ckpt_path={workdir / 'inf.ckpt'}")
    stopped = [
        name
        for name, run in (("data", data), ("checkpoint", weights))
        if "Training stopped at step" in run["output"]
    ]
    said = "a.jsonl: line 2: missing column 'answer'" in data["output"]
    said &= "NonFiniteWeightsError: The weights restored from" in weights["output"]
    ok = data["code"] != 0 and weights["code"] != 0 and said and not stopped
    detail = f"'Training stopped at step' after: {stopped or 'neither'}; {last_error(data['output'])}"
    return verdict(ok, "clear error"), detail, {"output": data["output"] + weights["output"]}


def exgrpo_test(workdir: Path, disk: Path, *questions: int) -> dict:
    """`exgrpo test` of the quickstart's untrained policy on a named set of each count of `questions`
    (`set0`, `set1`, ...), its table (test.json, test.md) and config.yaml written into `disk`."""
    sets = ", ".join(
        f"set{i}: {{synthetic: {{class_path: exgrpo_pl.data.ReasoningTask, init_args: {{num_questions: {n},"
        f" seed: {i}}}}}}}"
        for i, n in enumerate(questions)
    )
    return exgrpo(
        workdir, "--data.val_fraction=0", f"--data.eval_sets={{{sets}}}", "--trainer.logger=false",
        f"--trainer.default_root_dir={disk}", subcommand="test",
    )  # fmt: skip


# A rerun's table (two sets of every family) is several pages longer than the first run's (one set of four
# questions): rewritten in place, the previous file's pages it frees on a full disk do not hold it.
RERUN = (64, 64)


@contextlib.contextmanager
def filled_when(disk: Path, ready: Callable[[], bool]):
    """While the block runs, fills `disk` (a small tmpfs) to its last byte once `ready()` turns true."""
    done = threading.Event()

    def fill() -> None:
        while not ready():
            if done.wait(0.05):
                return
        with contextlib.suppress(OSError), open(disk / "ballast", "wb", buffering=0) as handle:
            while handle.write(bytes(2**20)):  # until ENOSPC
                pass

    thread = threading.Thread(target=fill, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def replaced(path: Path) -> Callable[[], bool]:
    """Whether `path` has been written anew since now, renamed over (a new inode) or rewritten in place (a new
    modification time), and is not empty."""

    def stamp() -> tuple[tuple[int, int], int]:
        status = path.stat()
        return (status.st_ino, status.st_mtime_ns), status.st_size

    before = stamp()[0] if path.exists() else None

    def ready() -> bool:
        with contextlib.suppress(OSError):
            now, size = stamp()
            return now != before and size > 0
        return False

    return ready


REPORT = ("test.json", "test.md")


def leftovers(disk: Path) -> list[str]:
    return sorted(p.name for p in disk.iterdir() if p.name.startswith("."))  # the atomic writer's temp files


def probe_report_on_a_full_disk(workdir: Path) -> tuple[str, str, dict]:
    with small_disk(workdir, "16M") as disk:
        if disk is None:
            return "not run", "mounting a tmpfs needs root", {}
        with filled_when(disk, replaced(disk / "config.yaml")):  # full once the config is written
            run = exgrpo_test(workdir, disk, 4)
        named = re.search(rf"OutOfSpaceError: .*No space left to write {disk}/test\.(json|md)", run["output"])
        left = {name: (disk / name).stat().st_size for name in REPORT if (disk / name).exists()}
        temp = leftovers(disk)
    ok = run["code"] != 0 and named is not None and not left and not temp
    return (
        verdict(ok, "clear error"),
        f"report files left: {left}, temp files: {temp}; {last_error(run['output'])}",
        run,
    )


def probe_rerun_report_on_a_full_disk(workdir: Path) -> tuple[str, str, dict]:
    with small_disk(workdir, "16M") as disk:
        if disk is None:
            return "not run", "mounting a tmpfs needs root", {}
        first = exgrpo_test(workdir, disk, 4)
        assert first["code"] == 0, first["output"][-2000:]
        previous = {name: (disk / name).read_bytes() for name in REPORT}
        with filled_when(disk, replaced(disk / "config.yaml")):
            run = exgrpo_test(workdir, disk, *RERUN)
        kept = {name: (disk / name).read_bytes() == previous[name] for name in REPORT}
        try:
            whole = json.loads((disk / "test.json").read_text())["rows"]["set0"]["problems"] == 4
        except ValueError:  # cut short: not JSON
            whole = False
        temp = leftovers(disk)
    named = re.search(rf"No space left to write {disk}/test\.(json|md)", run["output"]) is not None
    ok = run["code"] != 0 and named and all(kept.values()) and whole and not temp
    detail = f"previous run's files kept: {kept}, test.json whole: {whole}, temp files: {temp}"
    return verdict(ok, "clear error"), f"{detail}; {last_error(run['output'])}", run


def probe_config_on_a_full_disk(workdir: Path) -> tuple[str, str, dict]:
    with small_disk(workdir, "16M") as disk:
        if disk is None:
            return "not run", "mounting a tmpfs needs root", {}
        first = exgrpo_test(workdir, disk, 4)
        assert first["code"] == 0, first["output"][-2000:]
        previous = (disk / "config.yaml").read_bytes()
        with filled_when(disk, lambda: True):  # full from the start: the config is the first file written
            run = exgrpo_test(workdir, disk, *RERUN)
        kept = (disk / "config.yaml").read_bytes() == previous
        temp = leftovers(disk)
    named = f"No space left to write {disk}/config.yaml" in run["output"]
    ok = run["code"] != 0 and named and kept and not temp
    detail = f"previous config.yaml kept: {kept}, temp files: {temp}"
    return verdict(ok, "clear error"), f"{detail}; {last_error(run['output'])}", run


# ------------------------------------------------------------------------------------------ issue 54
def exgrpo_export(workdir: Path, *args: str) -> dict:
    """`exgrpo export` with `args` (under umask 022, as a shell's default)."""
    started = time.monotonic()
    command = [sys.executable, "-m", "exgrpo_pl.cli", "export", *args]
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=600, umask=0o022)
    return {
        "code": done.returncode,
        "seconds": time.monotonic() - started,
        "output": done.stdout + done.stderr,
    }


def probe_export_over_its_run(workdir: Path) -> tuple[str, str, dict]:
    checkpoint = full_checkpoint(workdir)
    run_folder = checkpoint.parents[1]  # lightning_logs/version_0: checkpoints, hparams.yaml, events
    before = sorted(str(p.relative_to(run_folder)) for p in run_folder.rglob("*"))
    run = exgrpo_export(
        workdir, "--ckpt_path", str(checkpoint), "--out", str(run_folder), "--overwrite", "true"
    )
    after = sorted(str(p.relative_to(run_folder)) for p in run_folder.rglob("*"))
    ok = run["code"] != 0 and after == before and "holds what no export wrote" in run["output"]
    return verdict(ok, "clear error"), f"run kept whole: {after == before}; {last_error(run['output'])}", run


def check_report_pair_split_by_a_kill(workdir: Path) -> tuple[bool, str]:
    """a kill between the renames"""
    from exgrpo_pl.checkpoints import atomic_writes
    from exgrpo_pl.evaluation.report import report_files, report_is_whole

    def table(metric: str) -> dict:
        return {"rows": {"set0": {metric: 0.5, "problems": 4}}, "averages": {}}

    atomic_writes.write_files_atomically(report_files(table("avg@4"), workdir, "test"))
    whole_before = report_is_whole(workdir / "test.json", workdir / "test.md")
    replace, renamed = atomic_writes.os.replace, []

    def killed_after_the_first(source, target):  # SIGKILL's effect on the disk, between the two renames
        if renamed:
            raise KeyboardInterrupt
        renamed.append(Path(target).name)
        replace(source, target)

    atomic_writes.os.replace = killed_after_the_first
    try:
        with contextlib.suppress(KeyboardInterrupt):
            atomic_writes.write_files_atomically(report_files(table("avg@2"), workdir, "test"))
    finally:
        atomic_writes.os.replace = replace
    told = whole_before and not report_is_whole(workdir / "test.json", workdir / "test.md")
    detail = f"renamed before the kill: {renamed}; the pair's digest tells it split: {told}"
    return told and renamed == ["test.md"], detail


def probe_max_steps_not_whole_batches(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo(workdir, "--model.steps_per_generation=2", "--trainer.max_steps=3")
    said = "max_steps=3: not a multiple of the 2 optimizer updates" in run["output"]
    return verdict(run["code"] != 0 and said, "clear error"), last_error(run["output"]), run


def probe_prompt_past_the_models_positions(workdir: Path) -> tuple[str, str, dict]:
    rows = sums(8)
    rows.insert(3, {"prompt": "1+" * 100 + "=", "answer": "100"})  # 201 tokens; the model has 64 positions
    path = write_jsonl(workdir / "train.jsonl", rows)
    run = exgrpo(
        workdir, "--trainer.max_steps=2", f"--data.train_path={path}", "--model.max_prompt_length=512"
    )
    said = re.search(
        r"train\.jsonl: line 4: the prompt of .* has 201 tokens, .*max_position_embeddings=64", run["output"]
    )
    return verdict(run["code"] != 0 and said is not None, "clear error"), last_error(run["output"]), run


SWAP = replay_callback(
    mode="swap", min_buffer_size=1, max_consecutive_replay_steps=2,
    replay="{class_path: exgrpo_pl.experience.SelectiveReplay, init_args: {replay_probability: 1.0}}",
)  # fmt: skip


def probe_swap_reward_logging(workdir: Path) -> tuple[str, str, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = workdir / "run"
    run = exgrpo(
        workdir,
        "--trainer.max_steps=6",
        "--trainer.log_every_n_steps=1",
        SWAP,
        f"--trainer.default_root_dir={root}",
    )
    if run["code"] != 0:
        return "FAILED", last_error(run["output"]), run
    run_folder = next(path for path in root.glob("lightning_logs/*") if path.is_dir())  # not the HParams file
    events = EventAccumulator(str(run_folder)).Reload()
    swapped = {e.step for e in events.Scalars("replay/row_fraction") if e.value == 1.0}
    logged = {
        tag: {e.step for e in events.Scalars(tag)} & swapped
        for tag in events.Tags()["scalars"] if tag.startswith("train/reward")
    }  # fmt: skip
    ok = bool(swapped) and "train/reward" in logged and not any(logged.values())
    return verdict(ok, "works"), f"swap steps {sorted(swapped)}; reward charts written on them: {logged}", run


def probe_export_file_modes(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo_export(
        workdir, "--ckpt_path", str(full_checkpoint(workdir)), "--out", str(workdir / "policy")
    )
    modes = (
        {p.name: oct(p.stat().st_mode & 0o777) for p in (workdir / "policy").iterdir()}
        if run["code"] == 0
        else {}
    )
    ok = bool(modes) and set(modes.values()) == {"0o644"}
    return verdict(ok, "works"), f"under umask 022: {modes}", run


SCRIPT_REWARD = """
import sys
from lightning.pytorch import Trainer
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule

seen = []

def remembers(prompts, completions, **columns):
    seen.extend(completions)
    return [1.0] * len(completions)

if __name__ == "__main__":
    module = ExGRPOModule("embedded:tiny-arith", reward_funcs=[remembers], reward_timeout_seconds=30,
                          num_generations=2, max_completion_length=4)
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, limit_val_batches=0)
    trainer.fit(module, PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4))
    print(f"rows the reward saw, as this process sees them: {len(seen)}")
"""


def probe_stateful_script_reward(workdir: Path) -> tuple[str, str, dict]:
    (workdir / "train.py").write_text(SCRIPT_REWARD)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "train.py"], cwd=workdir, capture_output=True, text=True, timeout=600
    )
    run = {
        "code": done.returncode,
        "seconds": time.monotonic() - started,
        "output": done.stdout + done.stderr,
    }
    warned = "reward function 'remembers' is defined in your script" in run["output"]
    return verdict(run["code"] == 0 and warned, "clear warning"), last_error(run["output"]), run


def probe_swap_with_two_updates(workdir: Path) -> tuple[str, str, dict]:
    run = exgrpo(
        workdir, "--trainer.max_steps=16", "--model.steps_per_generation=2", "--data.batch_size=2",
        "--model.num_generations=2", SWAP,
    )  # fmt: skip
    if run["code"] == 0:
        return "works", "every swap step drew enough stored rows for its 2 updates", run
    named = "this swap replay step drew only" in run["output"] and "replay buffer" in run["output"]
    return verdict(named, "clear error"), last_error(run["output"]), run


def probe_export_on_a_full_disk(workdir: Path) -> tuple[str, str, dict]:
    checkpoint = full_checkpoint(workdir)
    with small_disk(workdir, "512K") as disk:  # the policy's weights take 1.3 MB (its checkpoint 4.1 MB)
        if disk is None:
            return "not run", "mounting a tmpfs needs root", {}
        run = exgrpo_export(workdir, "--ckpt_path", str(checkpoint), "--out", str(disk / "policy"))
        left = sorted(p.name for p in disk.iterdir())
    named = re.search(r"OutOfSpaceError: .*No space left to write \S*model\.safetensors", run["output"])
    ok = run["code"] != 0 and named is not None and not left
    return verdict(ok, "clear error"), f"left on the disk: {left}; {last_error(run['output'])}", run


def check_control_character_answer(workdir: Path) -> tuple[bool, str]:
    """d.jsonl: line 4: column 'answer' holds control character"""
    from exgrpo_pl.data import load_rows

    rows = sums(3) + [{"prompt": "7+8=", "answer": "15\u0000"}]
    loaded = load_rows(write_jsonl(workdir / "d.jsonl", rows))
    return False, f"loaded {len(loaded)} rows, the last answer {loaded[-1]['answer']!r}"


PROBES: dict[str, Callable[[Path], tuple[str, str, dict]]] = {
    "2 url checkpoint payload": probe_url_payload,
    "2 local checkpoint payload": probe_local_payload,
    "3 GIL-holding reward, 2 s limit": probe_gil_reward_limit,
    "3 SIGTERM in endless reward": functools.partial(probe_signal_during_reward, signum=signal.SIGTERM),
    "3 SIGINT in endless reward": functools.partial(probe_signal_during_reward, signum=signal.SIGINT),
    "5 disk full at 2nd save": probe_full_disk,
    "5 exception in training": probe_exception_in_training,
    "6 reward_weights [.nan]": probe_option(
        "--model.reward_weights=[.nan]", expect=r"reward_weights\[0\]=nan"
    ),
    "6 reward_weights [1e39]": probe_option(
        "--model.reward_weights=[1e39]", expect=r"reward_weights\[0\]=1e\+39"
    ),
    "6 learning_rate 1e38": probe_option(
        "--model.learning_rate=1e38", expect=r"learning_rate=1e\+38: must be"
    ),
    "6 num_generations 100000": probe_option(
        "--model.num_generations=100000", expect=r"num_generations=100000: a"
    ),
    "6 0-byte --ckpt_path": probe_incomplete_ckpt(b""),
    "6 truncated --ckpt_path": probe_truncated_ckpt,
    "6 max_steps mid-epoch name": probe_checkpoint_name,
    "6 torchinductor_root in TMPDIR": probe_inductor_dir,
    "29.1 bit-flipped --ckpt_path": probe_flipped_ckpt_path,
    "29.1 bit-flipped newest, last": probe_flipped_last,
    "29.1 inf weight in a checkpoint": probe_infinite_weight,
    "29.2 min_buffer_size > max_size": probe_option(
        replay_callback(min_buffer_size=200000),
        expect=r"min_buffer_size=200000: must be <= the buffer's max_size",
    ),
    "29.2 min_buffer_size 2, max_size 1": probe_option(
        replay_callback(
            min_buffer_size=2,
            buffer="{class_path: exgrpo_pl.experience.TrajectoryBuffer, init_args: {max_size: 1}}",
        ),
        expect=r"min_buffer_size=2: must be <= the buffer's max_size=1",
    ),
    "29.2 replay_start_epoch >= max_epochs": probe_option(
        "--trainer.max_epochs=2",
        replay_callback(replay_start_epoch=5),
        expect=r"replay_start_epoch=5: must be < trainer.max_epochs=2",
    ),
    "29.2 minimum above the run's rollouts": probe_unreachable_minimum,
    "29.3 text the tokenizer cannot read": probe_unreadable_text,
    "29.4 resume with other replay options": probe_changed_replay_options,
    "29.4 bad callback option, one line": probe_callback_option_alone,
    "29.4 reward_weights all zero": probe_option(
        "--model.reward_weights=[0.0]", expect=r"reward_weights=\[0.0\]: at least one must be non-zero"
    ),
    "37.1 dataset column 'completions'": probe_completions_column,
    "37.2 one-domain set averaged by domain": probe_one_domain_average,
    "37.3 one problem under two domains": probe_problem_in_two_domains,
    "37.4 validate_at_start, named sets only": probe_start_with_named_sets_only,
    "37.5 maj@k with RewardBySource": probe_maj_by_source,
    "37.6 messages as JSON text, no system": in_process(check_json_messages, "works"),
    "37.7 answers 37.0 and NaN": in_process(check_float_answers, "clear error"),
    "37.8 key added to one parquet message": in_process(check_ids_ignore_none_keys, "works"),
    "37.9 RewardBySource key 7, source 7": in_process(check_integer_source, "works"),
    "37.10 'Answer: I think it is B'": in_process(check_multiple_choice_pronoun, "works"),
    "37.11 resume on another training file": probe_resume_on_other_file,
    "37.12 plain state_dict as --ckpt_path": probe_plain_state_dict,
    "37.13 DeepSpeed folder, no model states": probe_deepspeed_folder_without_model_states,
    "37.14 evaluation set, num_samples 10^6": probe_huge_evaluation_set,
    "37.15 exgrpo test, disk full at report": probe_report_on_a_full_disk,
    "37.16 old module path in a .cfg config": probe_old_paths_in_a_cfg_file,
    "37.17 setup errors, no halfway warning": probe_setup_errors_alone,
    "37.18 rerun's report on a full disk": probe_rerun_report_on_a_full_disk,
    "37.19 rerun's config.yaml on a full disk": probe_config_on_a_full_disk,
    "54.1 export --overwrite onto its run": probe_export_over_its_run,
    "54.2 report pair, kill between renames": in_process(check_report_pair_split_by_a_kill, "detectable"),
    "54.3 max_steps 3, 2 updates a batch": probe_max_steps_not_whole_batches,
    "54.4 201-token prompt, 64 positions": probe_prompt_past_the_models_positions,
    "54.5 swap steps' reward charts": probe_swap_reward_logging,
    "54.6 exported files' modes": probe_export_file_modes,
    "54.7 stateful reward in the script": probe_stateful_script_reward,
    "54.8 swap, 2 updates, batch 2, K 2": probe_swap_with_two_updates,
    "54.9 export on a full disk": probe_export_on_a_full_disk,
    "54.10 answer '15\\u0000'": in_process(check_control_character_answer, "clear error"),
}


def outcome_counts(results: list[dict]) -> str:
    """How many of the probes in `results` ended in each outcome, as docs/reliability.md says it."""
    counts = collections.Counter(result["outcome"] for result in results)
    listed = ", ".join(f"{outcome} {count}" for outcome, count in counts.most_common())
    return f"{len(results)} probes: {listed}"


def markdown_table(results: list[dict]) -> str:
    """Each probe's outcome in `results` and the commit it ran at, as docs/reliability.md shows them (runs
    from before the file recorded commits say so)."""
    lines = ["| probe | outcome | code |", "|---|---|---|"]
    return "\n".join(
        lines
        + [
            f"| {result['probe']} | {result['outcome']} | {result.get('commit', 'not recorded')} |"
            for result in results
        ]
    )


def code_version() -> str:
    """The commit the probes ran at, with "+changes" when the package or this file differs from it."""
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    watched = ["exgrpo_pl", "callbacks", "configs", "benchmarks/hostile_probes.py"]
    changed = subprocess.run([*git, "status", "--porcelain", *watched], capture_output=True, text=True).stdout
    return commit.strip() + ("+changes" if changed.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default="", help="run the probes whose name contains this (the others' results are kept)"
    )
    args = parser.parse_args()
    path = RESULTS / "hostile_probes.json"
    kept = {r["probe"]: r for r in json.loads(path.read_text())} if args.only and path.exists() else {}
    commit = code_version()
    for name, probe in PROBES.items():
        if args.only not in name:
            continue
        with tempfile.TemporaryDirectory(prefix="probe-") as directory:
            started = time.monotonic()
            outcome, detail, run = probe(Path(directory))
            seconds = time.monotonic() - started
        print(f"{name:<40} {outcome:<12} {seconds:5.0f} s  {detail}", flush=True)
        tail = run.get("output", "")[-3000:]
        kept[name] = {
            "probe": name, "outcome": outcome, "seconds": round(seconds, 1), "detail": detail, "tail": tail,
            "commit": commit,
        }  # fmt: skip
    results = [kept[name] for name in PROBES if name in kept]  # in the probes' order
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{path}: {outcome_counts(results)}\n{markdown_table(results)}")


if __name__ == "__main__":
    main()

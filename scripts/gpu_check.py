"""The first GPU session in one command: smoke test, generation and memory benchmarks, one JSON, one table.

    bash scripts/gpu_check.sh                                   # one GPU, no hub (wheels: see gpu_smoke.sh)
    python scripts/gpu_check.py --out gpu_check.json            # the same, packages already installed
    python scripts/gpu_check.py --device cpu --tiny --out /tmp/gpu_check.json   # the plumbing, on a CPU

Parts, each a subprocess of the existing scripts with its own time limit, all within `--budget` seconds
(570 by default; a part that fails or runs out of time is recorded as such, with the end of its log, and
the others still run):

- `zero2`, `zero3`, `resume`, `plain`: `scripts/gpu_smoke.py`'s cases (a tiny policy, a few ExGRPO steps):
  step time, tokens/s, peak memory and the seconds per phase of a step (generation, reward, replay
  sampling and rescoring, update); `zero2` is the ZeRO-2 step split by phase, `resume` restores `zero3`'s
  DeepSpeed checkpoint on CUDA and checks the step and the replay buffer came back.
- `generation`: `benchmarks/generation.py --mode gpu` with the engines hf, static and hf-static
  (transformers' static cache): tokens/s, ratio to hf, share of the decode roofline at the 1.5B shape.
- `memory`: `benchmarks/memory.py --device cuda --strategy deepspeed_stage_2`: peak memory of a GRPO step
  and of the paper preset's step on the same work (the presets' ZeRO-2 precision: bf16 weights).
- `multi`: `scripts/gpu_multi.py` on every GPU (NCCL): ZeRO-2 and ZeRO-3 gradients against one GPU's, and
  a resume against the straight run. With fewer than 2 GPUs it runs nothing and the part says
  `skipped: N GPU(s)`, which counts as passing. It runs last: on a machine with several GPUs give it
  time with `--only multi` or a larger `--budget`.

With `--tiny` on a CPU only `plain`, an embedded-model generation (hf vs static-eager), memory's
`--quick` step and `multi` on 2 CPU processes (gloo) run, at toy sizes: the figures mean nothing, the
plumbing is what is checked. Everything runs from a scratch copy of the checkout (the benchmarks write
their results there, never into benchmarks/results); the JSON file holds every part's figures, its status
and seconds, the commit, torch and the device.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE_ORDER = ("zero2", "zero3", "resume", "plain")  # resume restores zero3's checkpoint
TAIL = 3000  # characters of a failed part's log kept in the JSON


def parts(device: str, tiny: bool) -> list[tuple[str, list[str], int]]:
    """(name, command relative to the scratch root, seconds allowed) of every part, in running order."""
    smoke = ["scripts/gpu_smoke.py", "--workdir", "smoke"]
    if tiny:
        smoke += [
            "--steps",
            "2",
            "--batch-size",
            "2",
            "--max-completion-length",
            "4",
            "--micro-batch-size",
            "8",
        ]
    if device == "cpu":
        smoke += ["--accelerator", "cpu"]
    variants = ("plain",) if device == "cpu" else SMOKE_ORDER
    found = [(v, [*smoke, "--variant", v], 300 if tiny else 120) for v in variants]
    if tiny:
        generation = ["--mode", "embedded", "--rows", "4", "--new-tokens", "4", "--rounds", "1"]
        generation += ["--engines", "hf", "static-eager", "--threads", "1"]
        memory = ["--quick", "--no-baseline", "--parts", "step", "--stored", "8"]
    else:
        generation = ["--mode", "gpu", "--rounds", "2", "--engines", "hf", "static", "hf-static"]
        memory = ["--device", "cuda", "--strategy", "deepspeed_stage_2", "--parts", "step"]
    found.append(("generation", ["benchmarks/generation.py", *generation], 300 if tiny else 240))
    found.append(("memory", ["benchmarks/memory.py", *memory], 300 if tiny else 150))
    multi = ["scripts/gpu_multi.py", "--device", device, "--workdir", "multi", *(["--tiny"] if tiny else [])]
    found.append(("multi", multi, 450))
    return found


def scratch_copy(target: Path) -> None:
    """The package (with `callbacks/` where the installed layout puts it), benchmarks and scripts."""
    for name in ("exgrpo_pl", "callbacks", "benchmarks", "scripts"):
        shutil.copytree(ROOT / name, target / name, ignore=shutil.ignore_patterns("results", "__pycache__"))
    shutil.copytree(ROOT / "callbacks", target / "exgrpo_pl" / "callbacks", dirs_exist_ok=True)


def run_part(command: list[str], seconds: float, cwd: Path, log: Path) -> tuple[str, float]:
    """Runs `python command` in `cwd` with the scratch copy first on PYTHONPATH; (status, seconds)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")])),
    }
    started = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(
                [sys.executable, *command],
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=seconds,
            ).returncode
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {seconds:.0f} s"
    return status, time.perf_counter() - started


def environment() -> dict:
    import torch

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return {
        "commit": commit.stdout.strip() or None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }


def figures(name: str, work: Path) -> dict | None:
    """What a part left in the scratch copy, or None."""
    if name in SMOKE_ORDER or name == "multi":
        path = work / "smoke" / f"{name}.result.json" if name != "multi" else work / "multi" / "result.json"
        return json.loads(path.read_text()) if path.is_file() else None
    path = work / "benchmarks" / "results" / f"{name}.json"
    if name == "memory" and not path.is_file():
        path = path.with_name("memory_quick.json")
    if not path.is_file():
        return None
    everything = json.loads(path.read_text())
    return next(iter(everything.values())) if len(everything) == 1 else everything


def table(report: dict) -> str:
    """The figures a reader looks for first, one line each."""
    lines = [f"gpu_check at {report['environment']['commit']} on {report['environment']['device']}"]
    for name, part in report["parts"].items():
        lines.append(f"  {name:<10} {part['status']:<24} {part['seconds']:7.1f} s")
        result = part.get("figures") or {}
        if name in SMOKE_ORDER and result:
            phases = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in result.get("timing_s", {}).items())
            lines.append(
                f"    step {result['step_time_s'] * 1000:.0f} ms, {result['tokens_per_s']:,.0f} tokens/s, "
                f"peak {result['peak_memory_gib']:.2f} GiB; {phases}"
            )
        elif name == "generation" and result:
            for engine, entry in result.get("engines", {}).items():
                share = f", {entry['roofline_share']:.1%} of roofline" if "roofline_share" in entry else ""
                ratio = f", {entry['ratio_to_hf']:.2f}x hf" if "ratio_to_hf" in entry else ""
                lines.append(f"    {engine:<13} {entry['median']:12,.0f} tokens/s{ratio}{share}")
        elif name == "multi":
            for check, entry in result.get("checks", {}).items():
                errors = entry.get("relative_error_by_step")
                figure = f"gradient off by {max(errors):.1e} of its largest entry" if errors else ""
                if "bitwise" in entry:
                    figure = f"{'bitwise' if entry['bitwise'] else 'not bitwise'} after stop at step "
                    figure += f"{entry['stopped_at']} and resume to {entry['steps']}"
                verdict = "ok" if entry["status"] == "ok" else "FAILED"
                lines.append(f"    {check:<7} {result['ranks']} ranks  {verdict:<7} {figure}")
                if verdict != "ok":
                    lines.append(f"      {entry['status'][:100]}")
        elif name == "memory" and result.get("step"):
            # As memory.py reports it: allocated peak on CUDA, resident memory above the step start on CPU.
            field = "above_start" if result["device"] == "cpu" else "peak"
            steps = result["step"]["after"]
            for label, entry in steps.items():
                mib, ratio = entry["step"][field] / 2**20, entry["step"][field] / steps["GRPO"]["step"][field]
                lines.append(f"    {label:<28} {mib:9.1f} MiB  {ratio:.3f}x GRPO  (step peak, {field})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: checks the plumbing only")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON file written")
    parser.add_argument("--only", nargs="+", help="run these parts only (names as in the table)")
    parser.add_argument("--budget", type=float, default=570, help="seconds for all parts together")
    args = parser.parse_args(argv)
    report = {"environment": environment(), "tiny": args.tiny, "parts": {}}
    if args.device == "cuda" and report["environment"]["device"] == "cpu":
        print("gpu_check: no CUDA device (use --device cpu --tiny to try the plumbing)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="exgrpo-gpu-check-") as tmp:
        work = Path(tmp)
        scratch_copy(work)
        deadline = time.perf_counter() + args.budget
        for name, command, seconds in parts(args.device, args.tiny):
            if args.only and name not in args.only:
                continue
            log = work / f"{name}.log"
            left = deadline - time.perf_counter()
            if left < 30:
                report["parts"][name] = {"status": "skipped (budget spent)", "seconds": 0.0}
                continue
            if name == "multi":  # its own budget, so that it writes its result before this one's ends
                command = [*command, "--budget", f"{min(seconds, left) - 20:.0f}"]
            status, took = run_part(command, min(seconds, left), work, log)
            found = figures(name, work) or {}
            if name == "multi" and status == "ok" and found.get("status", "").startswith("skipped:"):
                status = found["status"]  # fewer than 2 GPUs
            part = {"status": status, "seconds": took, "command": " ".join(["python", *command]),
                    "figures": found or None}  # fmt: skip
            if status != "ok":
                part["log_tail"] = log.read_text(errors="replace")[-TAIL:]
            report["parts"][name] = part
            print(f"gpu_check: {name}: {status} ({took:.0f} s)", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"gpu_check: every figure in {args.out}")
    # "skipped: N GPU(s)" (multi on one GPU) passes; "skipped (budget spent)" does not.
    passed = [p["status"] == "ok" or p["status"].startswith("skipped: ") for p in report["parts"].values()]
    return 0 if all(passed) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The multi-GPU leg of scripts/gpu_check.py: every GPU under NCCL, ZeRO-2 and ZeRO-3 against one GPU, resume.

    python scripts/gpu_multi.py --workdir /tmp/multi                 # every GPU; skipped with fewer than 2
    python scripts/gpu_multi.py --device cpu --tiny --workdir /tmp/multi    # the plumbing: 2 CPU processes

Each run is a process group started by `torchrun --standalone` (one process per GPU; the one-GPU reference is
a plain process), on a random Llama built from a config and saved with the embedded character tokenizer
(nothing from a hub; 512 wide and 4 layers, or 64 wide and 2 layers with `--tiny`), in float32 so that the
comparisons can be tight. The checks (`--checks`, all by default):

- `zero2`, `zero3`: the gradient of each of 2 optimizer steps on N ranks under DeepSpeed ZeRO-2 and ZeRO-3
  (every parameter sharded: `stage3_param_persistence_threshold` 0) against one process without DeepSpeed
  on the same global batch, without clipping. The rollouts are fixed (random tokens and rewards, each rank
  takes its share, as tests/step/test_update_ddp.py does), so sampling cannot make the runs differ; each
  rank's rows span 2 micro-batches. The gradient is read back from AdamW's first moment after each step,
  gathered with DeepSpeed's `safe_get_full_optimizer_state` (DeepSpeed reduces the gradients inside its
  step, where no hook sees them whole). Passes when every step's largest difference is at most 1e-4 of the
  reference's largest entry; step 2's gradient is taken at the weights the first update made.
- `resume`: N ranks under ZeRO-2 train 4 steps with sampling and replay (mix mode, from the first step);
  then 2 steps, a checkpoint (`SafeModelCheckpoint`), and `ckpt_path="last"` (as `exgrpo fit --ckpt_path
  last`) on to step 4. The final weights (gathered) and every rank's replay buffer, replay generators and
  replay count must equal the straight run's bitwise, and every rank must have replayed after the resume.
  On CUDA the workers run with `torch.use_deterministic_algorithms` and eager attention, so that the same
  inputs give the same bits.

On a CPU (`--device cpu`) the same checks run on `--ranks` processes (2 by default) with gloo; Lightning's
DeepSpeed strategy refuses a CPU, so the workers skip that one check (DeepSpeed's engine is the real one).
The result file (`--out`, default WORKDIR/result.json) holds each check's status, figures and seconds; with
`--device cuda` and fewer than 2 GPUs it holds `"status": "skipped: N GPU(s)"` and nothing runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

GRAD_STEPS, RESUME_STEPS, STOP_AT = 2, 4, 2
GRAD_TOLERANCE = 1e-4  # of the largest gradient entry
K, PROMPTS_PER_RANK, COMPLETION = 4, 2, 4
CHECKS = ("zero2", "zero3", "resume")
TAIL = 3000  # characters of a failed launch's log kept in the result


# --- the worker: one process of one run (under torchrun when there are several) ---------------------------


def strategy(name: str, args: argparse.Namespace):
    """The run's strategy: single-device for the reference, DeepSpeed ZeRO-2/3 otherwise."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    if name == "reference":
        return "auto"
    stage = 3 if name == "zero3" else 2
    if args.device == "cuda":
        chosen = DeepSpeedStrategy(stage=stage)
    else:

        class CPUDeepSpeedStrategy(DeepSpeedStrategy):
            """Lightning's DeepSpeedStrategy without its CUDA-only check, on CPU processes (gloo)."""

            def setup_environment(self) -> None:
                DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's CUDAAccelerator check

        devices = [torch.device("cpu", i) for i in range(args.ranks)]
        chosen = CPUDeepSpeedStrategy(stage=stage, parallel_devices=devices)
    # Lightning's config for the stage, with every parameter sharded: ZeRO-3 keeps parameters below 1e5
    # elements whole on every rank by default, which would leave a small model unsharded.
    chosen.config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return chosen


def module_class(fixed: bool):
    """ExGRPOModule, or its subclass that samples nothing: one fixed batch a step, each rank its share."""
    from exgrpo_pl.module import ExGRPOModule
    from exgrpo_pl.step.sampling import fresh_rollouts

    if not fixed:
        return ExGRPOModule

    class FixedRollouts(ExGRPOModule):
        def _collect(self, plan, temperature):
            gen = torch.Generator().manual_seed(self.global_step)
            rows = plan.num_rollouts * self.trainer.world_size
            prompts = torch.randint(3, len(self.tokenizer), (rows, 3), generator=gen)
            completions = torch.randint(3, len(self.tokenizer), (rows, COMPLETION), generator=gen)
            lengths = torch.randint(1, COMPLETION + 1, (rows,), generator=gen)
            mask = torch.arange(COMPLETION) < lengths.unsqueeze(1)
            rewards = torch.rand(rows, generator=gen) * 2
            mine = slice(self.global_rank * plan.num_rollouts, (self.global_rank + 1) * plan.num_rollouts)
            fresh = fresh_rollouts(
                plan, prompts[mine], torch.ones_like(prompts[mine]), completions[mine], mask[mine],
                rewards[mine],
            )  # fmt: skip
            return fresh.to(self.device), {"generated_tokens": 0}

    return FixedRollouts


def first_moments(module) -> torch.Tensor:
    """AdamW's first moment of every parameter, whole, flat, float32 on the CPU (a collective under DeepSpeed,
    whose optimizer keeps it sharded: `safe_get_full_optimizer_state`)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    state = module.trainer.optimizers[0].state
    moments = [
        safe_get_full_optimizer_state(p, "exp_avg") if p not in state else state[p]["exp_avg"]
        for p in module.policy.parameters()
    ]
    return torch.cat([m.detach().float().flatten().cpu() for m in moments])


def step_gradients(moments: list[torch.Tensor], beta1: float) -> list[torch.Tensor]:
    """The gradient each AdamW step applied, from the first moment after each step (`moments`):
    m_k = b1 m_(k-1) + (1 - b1) g_k."""
    previous = [torch.zeros_like(moments[0]), *moments[:-1]] if moments else []
    return [(m - beta1 * before) / (1 - beta1) for m, before in zip(moments, previous)]


def full_weights(module) -> torch.Tensor:
    """Every parameter, whole (gathered under ZeRO-3: a collective), flat, float32 on the CPU."""
    import deepspeed

    params = list(module.policy.parameters())
    sharded = [p for p in params if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(sharded, enabled=bool(sharded)):
        return torch.cat([p.detach().float().flatten().cpu() for p in params])


def recorder(out: Path, resume: bool):
    """A callback that writes what the comparison needs: each step's gradient (rank 0's file), or at the end
    the weights and each rank's replay state (a file per rank)."""
    from lightning.pytorch import Callback

    class Record(Callback):
        def __init__(self) -> None:
            self.moments: list[torch.Tensor] = []
            self.started_at = 0

        def on_train_start(self, trainer, pl_module) -> None:
            self.started_at = trainer.global_step  # the restored step when resumed

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if not resume:  # one optimizer step a batch
                self.moments.append(first_moments(pl_module))

        def on_train_end(self, trainer, pl_module) -> None:
            import torch.distributed as dist

            from exgrpo_pl.callbacks import ReplayCallback

            record = {
                "backend": dist.get_backend() if dist.is_initialized() else None,
                "world_size": trainer.world_size,
                "global_step": trainer.global_step,
                "started_at": self.started_at,
                "grads": step_gradients(self.moments, trainer.optimizers[0].param_groups[0]["betas"][0]),
            }
            if resume:
                replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
                weights = full_weights(pl_module)  # every rank takes part in the gather
                record.update(
                    weights=weights if trainer.is_global_zero else None,
                    buffer=replay.buffer.state_dict(),
                    generators=replay.replay.state_dict(),
                    replayed_steps=replay.replayed_steps,
                )
            if resume or trainer.is_global_zero:
                torch.save(record, out / f"rank{trainer.global_rank}.pt")

    return Record()


def worker(args: argparse.Namespace) -> None:
    """One process of run `args.worker`: reference, zero2, zero3, straight, stopped or resumed."""
    from lightning.pytorch import Trainer, seed_everything

    from exgrpo_pl.callbacks import ReplayCallback
    from exgrpo_pl.checkpoints import SafeModelCheckpoint
    from exgrpo_pl.data import ArithmeticTask, PromptDataModule
    from exgrpo_pl.experience import SelectiveReplay
    from exgrpo_pl.rewards import FormatReward

    if args.device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    seed_everything(0)
    resume = args.worker in ("straight", "stopped", "resumed")
    out = Path(args.workdir) / args.worker
    out.mkdir(parents=True, exist_ok=True)
    ranks = 1 if args.worker == "reference" else args.ranks
    module = module_class(fixed=not resume)(
        model_name_or_path=str(Path(args.workdir) / "model"), num_generations=K,
        max_completion_length=COMPLETION, learning_rate=1e-3, micro_batch_size=K * PROMPTS_PER_RANK // 2,
        reward_funcs=[FormatReward(r"[0-9].*")], reward_timeout_seconds=None,
        max_grad_norm=1.0 if resume else 0.0,  # a clip would hide a gradient of the wrong size
        attn_implementation="eager",
    )  # fmt: skip
    callbacks = [recorder(out, resume)]
    if resume:
        callbacks.append(
            ReplayCallback(
                replay=SelectiveReplay("uniform", replay_probability=1.0), mode="mix", mix_fraction=0.5,
                min_buffer_size=1,
            )
        )  # fmt: skip
        folder = Path(args.workdir) / ("straight" if args.worker == "straight" else "split") / "ckpts"
        callbacks.append(SafeModelCheckpoint(dirpath=folder, save_last="link", every_n_train_steps=STOP_AT))
    trainer = Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=ranks,
        strategy=strategy("zero2" if resume else args.worker, args), precision="32-true",
        max_steps=STOP_AT if args.worker == "stopped" else (RESUME_STEPS if resume else GRAD_STEPS),
        max_epochs=100, logger=False, enable_checkpointing=resume, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        default_root_dir=out, callbacks=callbacks,
    )  # fmt: skip
    data = PromptDataModule(
        synthetic=ArithmeticTask(num_questions=256, seed=0), val_fraction=0.0,
        batch_size=PROMPTS_PER_RANK * (args.ranks // ranks),  # the reference takes every rank's prompts
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path="last" if args.worker == "resumed" else None)


# --- the leg: launches the runs and compares them -------------------------------------------------------


def save_model(folder: Path, tiny: bool) -> None:
    """A random Llama built from a config, with the embedded model's character tokenizer."""
    from transformers import LlamaForCausalLM

    from exgrpo_pl.data import ARITHMETIC_ALPHABET
    from exgrpo_pl.models import build_char_tokenizer, tiny_llama_config

    tokenizer = build_char_tokenizer(ARITHMETIC_ALPHABET)
    torch.manual_seed(0)
    width, layers = (64, 2) if tiny else (512, 4)
    LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=width, num_layers=layers)).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)


def launch(run: str, args: argparse.Namespace, seconds: float) -> tuple[str, float]:
    """Runs worker `run` (under torchrun with `args.ranks` processes unless it is the one-process reference);
    (status, seconds). Its log is WORKDIR/<run>.log."""
    workdir = Path(args.workdir)
    worker = [__file__, "--worker", run, "--device", args.device, "--ranks", str(args.ranks)]
    worker += ["--workdir", str(workdir)]
    if run != "reference":
        worker = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", *worker]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if args.device == "cpu":
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # torchrun --standalone listens on localhost
    else:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (the resume check)
    started = time.perf_counter()
    with open(workdir / f"{run}.log", "w") as log:
        try:
            code = subprocess.run(
                [sys.executable, *worker], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=seconds
            ).returncode
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {seconds:.0f} s"
    return status, time.perf_counter() - started


def compare_grads(reference: list[torch.Tensor], sharded: list[torch.Tensor]) -> dict:
    """Each step's largest gradient difference as a share of the reference's largest entry; the status says
    whether every step is within GRAD_TOLERANCE."""
    if len(reference) != len(sharded):
        return {"status": f"failed: {len(sharded)} steps' gradients against the reference's {len(reference)}"}
    errors = [float((s - r).abs().max() / r.abs().max().clamp_min(1e-30)) for r, s in zip(reference, sharded)]
    worst = max(errors, default=0.0)
    ok = bool(errors) and worst <= GRAD_TOLERANCE and all(float(r.abs().max()) > 0 for r in reference)
    verdict = "ok" if ok else f"failed: gradient off by {worst:.2e} of its largest entry (> {GRAD_TOLERANCE})"
    return {"status": verdict, "relative_error_by_step": errors, "tolerance": GRAD_TOLERANCE}


def differences(a, b, path: str = "") -> list[str]:
    """Where two records differ (tensors bitwise), as paths with the largest tensor difference."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"]
        if torch.equal(a, b):
            return []
        gap = float((a.double() - b.double()).abs().max()) if a.is_floating_point() else "values"
        return [f"{path}: differs (largest difference {gap})"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def compare_resume(straight: list[dict], stopped: list[dict], resumed: list[dict]) -> dict:
    """The resumed run's weights and every rank's replay state against the straight run's, bitwise; the
    steps after the resume must have replayed on every rank."""
    keys = ("global_step", "weights", "buffer", "generators", "replayed_steps")
    found = differences(
        [{k: r[k] for k in keys} for r in straight], [{k: r[k] for k in keys} for r in resumed]
    )
    after = [end["replayed_steps"] - stop["replayed_steps"] for stop, end in zip(stopped, resumed)]
    problems = found + (["a rank replayed nothing after the resume"] if min(after) == 0 else [])
    if resumed[0]["started_at"] != STOP_AT:  # a run from step 0 would match the straight one too
        problems.append(f"the resumed run started at step {resumed[0]['started_at']}, not {STOP_AT}")
    return {
        "status": "ok" if not problems else "failed: " + "; ".join(problems[:5]),
        "bitwise": not found,
        "stopped_at": STOP_AT,
        "steps": RESUME_STEPS,
        "replayed_after_resume_by_rank": after,
        "buffer_rows_by_rank": [len(r["buffer"]["question_id"]) for r in resumed],
    }


def records(workdir: Path, run: str, ranks: int) -> list[dict]:
    """What each rank of `run` wrote (rank 0 alone for the gradient runs)."""
    return [torch.load(workdir / run / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def leg(args: argparse.Namespace) -> dict:
    """The checks in `args.checks`, every run within the seconds left of `args.budget`; the result."""
    workdir = Path(args.workdir)
    save_model(workdir / "model", args.tiny)
    deadline = time.perf_counter() + args.budget
    result: dict = {"ranks": args.ranks, "device": args.device, "checks": {}}
    runs = {"zero2": ["zero2"], "zero3": ["zero3"], "resume": ["straight", "stopped", "resumed"]}
    done: dict[str, str] = {}  # run -> status: the reference runs once for both gradient checks
    for check in args.checks:
        took, status = 0.0, "ok"
        for run in (["reference"] if check != "resume" else []) + runs[check]:
            if run not in done:
                left = deadline - time.perf_counter()
                done[run], seconds = launch(run, args, left) if left > 10 else ("skipped (budget spent)", 0.0)
                took += seconds
            if done[run] != "ok":
                status = f"{run}: {done[run]}"
                break
        if status != "ok":
            log = workdir / f"{status.split(':')[0]}.log"
            entry = {
                "status": status,
                "log_tail": log.read_text(errors="replace")[-TAIL:] if log.is_file() else "",
            }
        elif check == "resume":
            entry = compare_resume(*(records(workdir, run, args.ranks) for run in runs[check]))
        else:
            ((run,), (reference,)) = records(workdir, check, 1), records(workdir, "reference", 1)
            entry = compare_grads(reference["grads"], run["grads"])
            entry.update(backend=run["backend"], world_size=run["world_size"])
        entry["seconds"] = took
        result["checks"][check] = entry
        print(f"gpu_multi: {check}: {entry['status']} ({took:.0f} s)", flush=True)
    result["status"] = "ok" if all(c["status"] == "ok" for c in result["checks"].values()) else "failed"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--ranks", type=int, help="processes (default: every GPU; 2 on a CPU)")
    parser.add_argument("--tiny", action="store_true", help="a 64-wide, 2-layer model (any device)")
    parser.add_argument("--workdir", required=True, help="where the runs, logs and checkpoints go")
    parser.add_argument("--out", help="the result file (default WORKDIR/result.json)")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS), help="which to run")
    parser.add_argument("--budget", type=float, default=300, help="seconds for every run together")
    parser.add_argument("--worker", choices=("reference", "zero2", "zero3", "straight", "stopped", "resumed"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    gpus = torch.cuda.device_count()
    workdir = Path(args.workdir).resolve()  # the workers find the model by this path, not as a hub id
    workdir.mkdir(parents=True, exist_ok=True)
    args.workdir, out = str(workdir), Path(args.out or workdir / "result.json")
    if args.device == "cuda" and gpus < 2:
        result = {"status": f"skipped: {gpus} GPU(s)", "ranks": gpus, "device": "cuda"}
    else:
        args.ranks = args.ranks or (gpus if args.device == "cuda" else 2)
        if args.ranks < 2 or (args.device == "cuda" and args.ranks > gpus):
            parser.error(f"--ranks {args.ranks}: give 2 or more" + (f", at most {gpus}" if gpus else ""))
        result = leg(args)
    out.write_text(json.dumps(result, indent=1))
    print(f"gpu_multi: {result['status']}; every figure in {out}")
    return 0 if result["status"] == "ok" or result["status"].startswith("skipped:") else 1


if __name__ == "__main__":
    sys.exit(main())

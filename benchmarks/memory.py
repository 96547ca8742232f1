"""Peak memory of a GRPO step and of the paper preset's step on the same work, and of the rescoring call.

The paper preset (mix mode, Gaussian question sampling, lowest entropy under the current policy, entropy
bonus 0.001, policy shaping) rescores every stored trajectory of the sampled questions before it generates;
GRPO (entropy bonus 0) does not. Both train a random-init Qwen2 on the same batch (questions x K rollouts,
completions run to the full budget), with the same micro-batch, in bf16. The preset's buffer is filled
beforehand with `--stored` trajectories of the questions it replays, so each replay step rescores them all.

Each measurement runs in its own process (a clean peak counter), on the second training step (the first
allocates the optimizer state, and replays nothing: the buffer is filled just before the second):
- CPU: peak resident memory (VmHWM, reset through /proc/self/clear_refs at each phase), with
  MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB so every tensor buffer is its own mapping, returned on free:
  resident memory then follows the live tensors, and the peak above the phase's start is its working memory.
  A torch.profiler memory trace would be finer but misses allocations of some CPU kernels; RSS sees all.
- CUDA: torch.cuda.max_memory_allocated (and max_memory_reserved), reset at each phase.

Phases: replay sampling and rescoring (`score_entropy`; the preset only), generation (and rewards), the
update (`update_policy`: forwards, backwards, optimizer step). "step" is the whole training step. The
rescoring call is also measured alone, on 64 and 1024 stored trajectories with the module's default
rescoring micro-batch. "engine": one rollout call of the step's shape (questions x K rows, a 64-token prompt,
the full budget) with the `hf` and the `static` engine (warmed up first, as before training): its peak, and
the static engine's KV arena, which it keeps between calls (working tree only).

On CPU the code before chunked log-probs (the parent of the commit that added exgrpo_pl/logprobs.py, now
exgrpo_pl/step/logprobs.py, checked out in a temporary git worktree) runs the same measurements ("before"),
next to the working tree ("after").

    python benchmarks/memory.py                    # CPU: ~10M-parameter model, 32K vocabulary, before/after
    python benchmarks/memory.py --quick            # tiny shapes (plumbing)
    python benchmarks/memory.py --device cuda      # GPU: 1.5B-shaped Qwen2, 16 x 8 rollouts x 256 tokens

Writes benchmarks/results/memory.json (one entry per device) and memory.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL = {  # Qwen2 shapes; the vocabulary is the point: logits are rows x positions x vocab
    "cpu": dict(vocab_size=32768, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2),
    "quick": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    "cuda": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),  # Qwen2.5-Math-1.5B
}  # fmt: skip
WORK = {  # questions per step, K, completion tokens, training micro-batch
    "cpu": dict(questions=8, k=8, completion=128, micro_batch_size=8),
    "quick": dict(questions=4, k=4, completion=16, micro_batch_size=4),
    "cuda": dict(questions=16, k=8, completion=256, micro_batch_size=4),  # the 1.5B preset's micro-batch
}
VARIANTS = ("GRPO", "paper preset")
STORED = (64, 1024)
PARTS = ("softmax", "rescore", "step", "engine")
ENGINE_PROMPT = 64
"""Prompt tokens of each row in the engine measurement (its rows and budget are the step's)."""


# ------------------------------------------------------------------------------------------- meters
class Meter:
    """Peak memory since the last `reset()`: resident memory on CPU, allocated memory on CUDA."""

    def __init__(self, device: str) -> None:
        self.device = device

    def reset(self) -> int:
        """Start a new peak; returns the memory in use now."""
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        return _status("VmRSS")

    def peak(self) -> int:
        import torch

        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _status("VmHWM")

    def reserved(self) -> int | None:
        import torch

        return torch.cuda.max_memory_reserved() if self.device == "cuda" else None


def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


class Phases:
    """Peaks per phase of one step; `mark(name)` closes the running phase and opens `name`."""

    def __init__(self, meter: Meter) -> None:
        self.meter, self.name, self.start, self.step_start, self.started = meter, None, 0, 0, 0.0
        self.result: dict[str, dict[str, float]] = {}
        self.step_peak = 0

    def mark(self, name: str | None) -> None:
        if self.name is not None:
            seconds = time.perf_counter() - self.started
            peak = self.meter.peak()
            self.step_peak = max(self.step_peak, peak)
            entry = {"peak": peak, "above_start": peak - self.start, "seconds": seconds}
            reserved = self.meter.reserved()
            if reserved is not None:
                entry["reserved"] = reserved
            if self.name in self.result:  # a phase met twice (generation after rescoring): keep the larger
                seconds += self.result[self.name]["seconds"]
                entry = max(entry, self.result[self.name], key=lambda e: e["above_start"])
                entry["seconds"] = seconds
            self.result[self.name] = entry
        self.name = name
        if name is not None:
            self.start = self.meter.reset()
            self.started = time.perf_counter()


# ------------------------------------------------------------------------------------------- worker
def _fp32_weights(spec: dict) -> bool:
    """Whether the job trains without DeepSpeed: then in fp32 weights with bf16 compute (bf16-mixed), since
    nothing else keeps fp32 master weights of bf16 ones (`exgrpo_pl.module.strategies.check_strategy`)."""
    return spec["job"] == "step" and "deepspeed" not in str(spec["strategy"]).lower()


def worker(spec: dict) -> dict:
    """One measurement in this process (see `--worker`)."""
    import torch

    from exgrpo_pl.module import ExGRPOModule

    if spec["job"] == "softmax":
        return softmax_work(spec)
    device = spec["device"]
    work = spec["work"]
    preset = spec["variant"] == "paper preset"
    module = ExGRPOModule(
        model_name_or_path=spec["model_dir"], num_generations=work["k"],
        max_completion_length=work["completion"], micro_batch_size=spec["micro_batch_size"],
        learning_rate=1e-6, loss_type="dapo", scale_rewards="none" if preset else "group",
        entropy_coef=0.001 if preset else 0.0, off_policy_correction="shaping",
        dtype="float32" if _fp32_weights(spec) else "bfloat16",
        attn_implementation="sdpa", gradient_checkpointing=True, validate_at_start=False,
    )  # fmt: skip
    meter = Meter(device)
    if spec["job"] == "rescore":
        return _rescore_call(module, meter, spec)
    if spec["job"] == "engine":
        return _engine_call(module, meter, spec)
    torch.manual_seed(0)
    return _step(module, meter, spec, preset)


def _engine_call(module, meter: Meter, spec: dict) -> dict:
    """One rollout call of the step's shape (questions x K rows, the full budget) with `spec["engine"]`.

    The static engine is warmed up first (its KV arena allocated, its step compiled on CUDA), as the module
    does before training: the peak is that of a call in the middle of a run; `kv_arena` is what it keeps
    allocated between calls.
    """
    import torch

    from exgrpo_pl.engines import build_engine

    module.configure_model()
    module.to(spec["device"])
    work = spec["work"]
    engine = build_engine(spec["engine"], module.policy)
    sampling = module._sampling(1.0)
    rows = work["questions"] * work["k"]
    if spec["engine"] == "static":
        engine.warm_up([(rows, ENGINE_PROMPT, sampling)])
    ids = torch.randint(3, 100, (rows, ENGINE_PROMPT), device=spec["device"])
    sampling = type(sampling)(work["completion"], 1.0, 1.0, 0, (-1,))  # no stop token: the full budget
    start = meter.reset()
    started = time.perf_counter()
    out = engine.generate(ids, torch.ones_like(ids, dtype=torch.bool), sampling)
    seconds = time.perf_counter() - started
    return {
        "start": start, "peak": (peak := meter.peak()), "above_start": peak - start, "seconds": seconds,
        "reserved": meter.reserved(),
        "tokens": int(out.mask.sum()), "kv_arena": getattr(engine, "cache_bytes", 0),
    }  # fmt: skip


def _rescore_call(module, meter: Meter, spec: dict) -> dict:
    import torch

    module.configure_model()
    module.to(spec["device"])
    vocab = module.policy.config.vocab_size
    candidates = stored_rows(module, spec["stored"], spec["work"], vocab, question_ids=None)
    with torch.no_grad():
        module.score_entropy(candidates.select(list(range(module.num_generations))))  # first-call set-up
        start, started = meter.reset(), time.perf_counter()
        module.score_entropy(candidates)
        seconds, peak = time.perf_counter() - started, meter.peak()
    return {"peak": peak, "above_start": peak - start, "seconds": seconds,
            "forwards": module.entropy_forwards(candidates)}  # fmt: skip


def _step(module, meter: Meter, spec: dict, preset: bool) -> dict:
    from lightning.pytorch import Callback, Trainer

    # From the top level: the "before" checkout has the flat layout (exgrpo_pl.buffer, ...), this one the
    # folders.
    from exgrpo_pl import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
    from exgrpo_pl.callbacks import ReplayCallback
    from exgrpo_pl.data import ArithmeticTask, PromptDataModule

    work, measured_step = spec["work"], 1
    phases = Phases(meter)
    rescored: list[int] = []
    prefill = []  # the preset's stored trajectories, added to its buffer at the measured step

    class StepMeter(Callback):
        """Fills the buffer (so the warm-up step, with an empty buffer, does not replay) and opens the step's
        first phase, both before the ReplayCallback's rescoring; closes the last phase at the step's end."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == measured_step:
                for buffer, rows in prefill:
                    buffer.add(rows)
                phases.step_start = meter.reset()
                phases.mark("replay sampling" if prefill else "generation")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step - 1 == measured_step:
                phases.mark(None)

    def measured(name: str, fn, after: str):
        def call(*args, **kwargs):
            active = phases.name is not None
            if active:
                phases.mark(name)
            out = fn(*args, **kwargs)
            if active:
                phases.mark(after)
            return out

        return call

    score_entropy = module.score_entropy

    def counted_scoring(candidates, *args, **kwargs):
        rescored.append(len(candidates))
        return score_entropy(candidates, *args, **kwargs)

    module.score_entropy = measured("rescoring", counted_scoring, "generation")
    module.update_policy = measured("update", module.update_policy, "after update")
    data = PromptDataModule(
        synthetic=ArithmeticTask(num_questions=256, seed=0), batch_size=work["questions"], val_fraction=0.0
    )
    callbacks = [StepMeter()]
    if preset:
        replay = ReplayCallback(
            buffer=TrajectoryBuffer(keep="correct_of_partial", bucketer=DifficultyBucketer(window_size=8)),
            replay=SelectiveReplay("gaussian_lowest_entropy", replay_probability=1.0, gaussian_sigma=0.125),
            mode="mix", mix_fraction=0.5, min_buffer_size=1,
        )  # fmt: skip
        data.setup("fit")
        questions = data.train_rows[-max(1, work["questions"] // 2) :]  # the replayed questions
        prefill.append((replay.buffer, stored_rows(module, spec["stored"], work, spec["vocab"], questions)))
        callbacks.append(replay)
    trainer = Trainer(
        accelerator="gpu" if spec["device"] == "cuda" else "cpu", devices=1,
        precision="bf16-mixed" if _fp32_weights(spec) else "bf16-true",
        strategy=spec["strategy"], max_steps=measured_step + 1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return {
        "step": {"peak": phases.step_peak, "above_start": phases.step_peak - phases.step_start},
        "phases": phases.result,
        "rescored_rows": rescored[-1] if rescored else 0,
        "rescoring_forwards": module.entropy_forwards(range(rescored[-1])) if rescored else 0,
    }


def softmax_work(spec: dict) -> dict:
    """Log-probs and entropies of one training micro-batch's logits (random, bf16): the whole-tensor code
    before (one float32 copy of `[N, C, V]`, then `selective_log_softmax` and `token_entropy`) against the
    chunked `token_logps_and_entropy`; their agreement, peak memory and time, without and with a backward."""
    import statistics

    import torch

    from exgrpo_pl.step.logprobs import token_logps_and_entropy
    from exgrpo_pl.step.losses import selective_log_softmax, token_entropy

    device, work, vocab = spec["device"], spec["work"], spec["vocab"]
    rows, length = work["micro_batch_size"], work["completion"]
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, length + 1, vocab, generator=g, device=device) * 3).bfloat16()
    ids = torch.randint(0, vocab, (rows, length), generator=g, device=device)

    def whole(x):
        y = x[:, :-1].float() / 1.0  # [N, C, V] float32
        return selective_log_softmax(y, ids), token_entropy(y)

    def chunked(x, chunk_elements=None):
        options = {} if chunk_elements is None else {"chunk_elements": chunk_elements}
        return token_logps_and_entropy(x, ids, 1.0, **options)

    with torch.no_grad():
        want, got, small = whole(logits), chunked(logits), chunked(logits, 2**20)
    result = {
        "shape": [rows, length, vocab],
        "max_abs_diff": [float((a - b).abs().max()) for a, b in zip(got, want)],  # logps, entropies
        "within_1e-6": all(torch.allclose(a, b, rtol=1e-6, atol=1e-6) for a, b in zip(got, want)),
        "chunk_size_independent": all(torch.equal(a, b) for a, b in zip(got, small)),
    }
    meter = Meter(device)
    for grad in (False, True):
        seconds: dict[str, list[float]] = {"whole": [], "chunked": []}
        for repeat in range(6):  # alternating; the first round warms up
            for name, fn in (("whole", whole), ("chunked", chunked)):
                x = logits.detach().clone().requires_grad_(grad)
                start, started = meter.reset(), time.perf_counter()
                with torch.set_grad_enabled(grad):
                    logps, entropy = fn(x)
                    if grad:
                        (logps.sum() + entropy.sum()).backward()
                peak = meter.peak()  # synchronises on CUDA
                if repeat:
                    seconds[name].append(time.perf_counter() - started)
                result[f"{name} {'backward' if grad else 'no grad'}"] = {"above_start": peak - start}
                del x, logps, entropy
        for name, values in seconds.items():
            result[f"{name} {'backward' if grad else 'no grad'}"]["seconds"] = statistics.median(values)
    return result


def stored_rows(module, count: int, work: dict, vocab: int, question_ids):
    """`count` stored trajectories with full-length random completions, half of each question's correct.

    `question_ids`: dataset rows of the questions (prompt, answer, id), or None for random prompts of 16
    tokens under one question per K rows (the rescoring call alone).
    """
    import torch

    from exgrpo_pl.batch import RolloutBatch, pad_sequences

    g = torch.Generator().manual_seed(count)
    if question_ids is None:
        qids = torch.arange(count) // module.num_generations
        prompts = [torch.randint(3, vocab, (16,), generator=g) for _ in range(count)]
        texts, answers = [], []
    else:
        # Twice `count` rows, alternately right and wrong: the buffer keeps the right half (the paper's
        # correct_of_partial), spread evenly over the questions.
        rows = [question_ids[i % len(question_ids)] for i in range(2 * count)]
        qids = torch.tensor([row["id"] for row in rows])
        prompts = module.collector.encode([row["prompt"] for row in rows], qids)
        texts, answers = [row["prompt"] for row in rows], [str(row["answer"]) for row in rows]
    n = len(prompts)
    prompt_ids, prompt_mask = pad_sequences(prompts, left=True, pad_value=0)
    completion_ids = torch.randint(3, vocab, (n, work["completion"]), generator=g)
    rewards = (torch.arange(n) // len(question_ids or [0]) % 2 == 0).float()
    zeros = torch.zeros(n)
    return RolloutBatch(
        question_ids=qids, prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=torch.ones_like(completion_ids, dtype=torch.bool),
        behaviour_logps=-torch.rand(completion_ids.shape, generator=g), rewards=rewards,
        correct=rewards > 0.5, entropy=torch.rand(n, generator=g), advantages=zeros,
        policy_version=torch.zeros(n, dtype=torch.long), replayed=torch.zeros(n, dtype=torch.bool),
        prompts=texts, completions=[""] * n if texts else [], answers=answers,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------- driver
def build_model(directory: Path, shape: dict, device: str) -> None:
    """A random-init Qwen2 in bf16 and a character tokenizer, saved like any local checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from exgrpo_pl.data import ARITHMETIC_ALPHABET
    from exgrpo_pl.models import build_char_tokenizer

    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    build_char_tokenizer(ARITHMETIC_ALPHABET).save_pretrained(directory)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def run_worker(spec: dict, code: Path) -> dict:
    """`spec` measured in a fresh process importing exgrpo_pl from `code` (a checkout's root)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(code)}
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--code", str(code)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"worker {spec['job']} {spec.get('variant', '')} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def baseline_revision() -> str | None:
    """The commit before chunked log-probs: the parent of the commit that added exgrpo_pl/logprobs.py (the
    file's path then; it is exgrpo_pl/step/logprobs.py since the modules moved into folders)."""
    try:
        added = subprocess.run(
            ["git", "-C", str(ROOT), "log", "--diff-filter=A", "--format=%H", "--", "exgrpo_pl/logprobs.py"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{added[-1]}^" if added else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the plumbing")
    parser.add_argument("--baseline", help="git revision measured as 'before' (default: before logprobs.py)")
    parser.add_argument("--no-baseline", action="store_true", help="measure the working tree only")
    parser.add_argument("--stored", type=int, nargs="+", default=list(STORED), help="stored trajectories")
    parser.add_argument("--micro-batch-size", type=int, help="training micro-batch (default per device)")
    parser.add_argument("--strategy", default="auto", help="Lightning strategy, e.g. deepspeed_stage_2")
    parser.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (default: all)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--code", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # exgrpo_pl comes from PYTHONPATH=--code; its callbacks/ lives beside it (pyproject.toml)
        import exgrpo_pl

        exgrpo_pl.__path__.append(args.code)
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    sys.path.append(str(ROOT))  # for a checkout where exgrpo_pl is not installed (the GPU machine)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # killed: still remove the worktree and the worker
    key = "quick" if args.quick else args.device
    work = dict(WORK[key])
    if args.micro_batch_size:
        work["micro_batch_size"] = args.micro_batch_size
    codes = {"after": ROOT}
    compared = {"rescore", "step"} & set(args.parts) and not args.no_baseline and args.device == "cpu"
    revision = (args.baseline or baseline_revision()) if compared else None
    with tempfile.TemporaryDirectory() as tmp:
        if revision:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", f"{tmp}/before", revision],
                           check=True, capture_output=True)  # fmt: skip
            codes = {"before": Path(tmp) / "before", **codes}
        try:
            result = measure(args, key, work, codes, Path(tmp))
        finally:
            if revision:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", f"{tmp}/before"],
                               check=False, capture_output=True)  # fmt: skip
    if {"rescore", "step"} & set(args.parts):
        result["baseline_revision"] = revision
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "memory_quick" if args.quick else "memory"
    path = RESULTS / f"{name}.json"
    everything = json.loads(path.read_text()) if path.exists() else {}
    if set(args.parts) != set(PARTS) and args.device in everything:  # a partial rerun updates its parts
        result = {**everything[args.device], **result}
    everything[args.device] = result
    report(result)
    path.write_text(json.dumps(everything, indent=1))
    plot(everything, RESULTS / f"{name}.png")


def measure(args, key: str, work: dict, codes: dict[str, Path], tmp: Path) -> dict:
    import torch

    base = dict(device=args.device, work=work, vocab=MODEL[key]["vocab_size"], strategy=args.strategy)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": MODEL[key], "work": work, "torch": torch.__version__,
        "unit": "bytes; CPU: resident memory, CUDA: torch.cuda.max_memory_allocated",
    }  # fmt: skip
    if "softmax" in args.parts:
        result["softmax"] = run_worker(dict(base, job="softmax"), ROOT)
    if not {"rescore", "step", "engine"} & set(args.parts):
        return result
    base["model_dir"] = str(tmp / "model")
    build_model(tmp / "model", MODEL[key], args.device)
    if "engine" in args.parts:  # the working tree only: the arena is new
        result["engine"] = {}
        for engine in ("hf", "static"):
            spec = dict(base, job="engine", engine=engine, variant="GRPO", stored=0, micro_batch_size=None)
            entry = result["engine"][engine] = run_worker(spec, ROOT)
            print(
                f"engine {engine:6s} call of {work['questions'] * work['k']} rows x {ENGINE_PROMPT} + "
                f"{work['completion']} tokens: {_mib(entry)}, KV arena "
                f"{entry['kv_arena'] / 2**20:.1f} MiB, {entry['seconds']:.1f} s",
                flush=True,
            )
    for part in ("rescore", "step"):
        if part in args.parts:
            result[part] = {name: {} for name in codes}
    for name, code in codes.items():
        if "rescore" in args.parts and args.device == "cpu":  # the call alone, the default micro-batch
            for stored in args.stored:
                spec = dict(base, job="rescore", variant="paper preset", stored=stored, micro_batch_size=None)
                result["rescore"][name][str(stored)] = run_worker(spec, code)
                print(
                    f"{name:6s} rescoring call, {stored} stored: {_mib(result['rescore'][name][str(stored)])}"
                )
        if "step" not in args.parts:
            continue
        for variant, stored in [("GRPO", 0)] + [("paper preset", s) for s in args.stored]:
            label = variant if not stored else f"{variant} ({stored} stored)"
            spec = dict(
                base, job="step", variant=variant, stored=stored, micro_batch_size=work["micro_batch_size"]
            )
            result["step"][name][label] = run_worker(spec, code)
            print(f"{name:6s} {label:28s} step: {_mib(result['step'][name][label]['step'])}", flush=True)
    return result


def print_softmax(entry: dict) -> None:
    rows, length, vocab = entry["shape"]
    print(
        f"softmax work of {rows} rows x {length} tokens x {vocab}: chunked vs whole tensor, max abs diff "
        f"logps {entry['max_abs_diff'][0]:.2e}, entropies {entry['max_abs_diff'][1]:.2e} (within 1e-6: "
        f"{entry['within_1e-6']}); any chunk size the same bits: {entry['chunk_size_independent']}"
    )
    for mode in ("no grad", "backward"):
        whole, chunked = entry[f"whole {mode}"], entry[f"chunked {mode}"]
        print(
            f"  {mode:8s} whole {whole['above_start'] / 2**20:8.0f} MiB {whole['seconds'] * 1e3:8.1f} ms   "
            f"chunked {chunked['above_start'] / 2**20:8.0f} MiB {chunked['seconds'] * 1e3:8.1f} ms"
        )


def _mib(entry: dict) -> str:
    return f"peak {entry['peak'] / 2**20:9.1f} MiB, {entry['above_start'] / 2**20:9.1f} MiB above its start"


def report(result: dict) -> None:
    print(f"\n{result['device']}: Qwen2 {result['model']}, {result['work']}")
    absolute = result["device"] != "cpu"  # CPU: the process's baseline (Python, torch) is not GPU-like
    field = "peak" if absolute else "above_start"
    print(f"step peak ({'allocated' if absolute else 'resident memory above the step start'}), MiB:")
    for name, steps in result.get("step", {}).items():
        grpo = steps["GRPO"]["step"][field]
        for label, entry in steps.items():
            phases = ", ".join(
                f"{p} {e['above_start'] / 2**20:.0f} MiB {e['seconds']:.1f} s"
                for p, e in entry["phases"].items()
            )
            ratio = entry["step"][field] / grpo
            print(f"  {name:6s} {label:30s} {entry['step'][field] / 2**20:9.1f}  {ratio:5.2f}x GRPO   "
                  f"(above phase start: {phases}; rescored {entry['rescored_rows']} rows)")  # fmt: skip
    for name, calls in result.get("rescore", {}).items():
        line = ", ".join(
            f"{stored} stored {e['above_start'] / 2**20:.0f} MiB in {e['seconds']:.1f} s"
            for stored, e in calls.items()
        )
        print(f"  {name:6s} rescoring call alone (default micro-batch): {line}")
    if "softmax" in result:
        print_softmax(result["softmax"])
    if absolute and "step" in result:
        steps = result["step"]["after"]
        worst = max(e["step"]["peak"] for label, e in steps.items() if label != "GRPO")
        print(f"paper preset / GRPO peak: {worst / steps['GRPO']['step']['peak']:.3f} (target <= 1.05)")


def plot(everything: dict, path: Path) -> None:
    """Per device: the step peaks side by side, and (CPU) the rescoring call alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(device, "step") for device, result in everything.items() if result.get("step")]
    panels += [
        (device, "rescore") for device, result in everything.items() if result.get("rescore", {}).get("after")
    ]
    if not panels:  # the engine part alone is printed, not drawn
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (device, kind) in zip(axes[0], panels):
        result = everything[device]
        field = "above_start" if device == "cpu" else "peak"
        entries = result[kind]
        labels = list(entries["after"])
        width = 0.8 / len(entries)
        for i, (name, measured) in enumerate(entries.items()):
            values = [(measured[label]["step"] if kind == "step" else measured[label])[field] / 2**20
                      for label in labels]  # fmt: skip
            xs = [x + (i - (len(entries) - 1) / 2) * width for x in range(len(labels))]
            ax.bar_label(ax.bar(xs, values, width, label=name), fmt="%.0f", fontsize=7)
        names = [label.replace(" (", "\n(") if kind == "step" else f"{label} stored" for label in labels]
        ax.set_xticks(range(len(labels)), names, fontsize=8)
        unit = "MiB above its start (RSS)" if device == "cpu" else "MiB allocated"
        ax.set_ylabel(("step peak, " if kind == "step" else "rescoring call peak, ") + unit)
        work = result["work"]
        shape = f"vocab {result['model']['vocab_size']}, {work['completion']} tokens"
        what = (
            f"{work['questions']}x{work['k']} rollouts, micro-batch {work['micro_batch_size']}"
            if kind == "step"
            else "rescoring alone, the module's default micro-batch"
        )
        ax.set_title(f"{result['device']}: {shape}\n{what}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

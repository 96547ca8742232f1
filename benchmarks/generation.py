"""Rollout generation throughput: tokens/s of each engine on the same prompts and lengths, side by side.

Engines: `hf` (model.generate, dynamic cache: the reference), `static-eager` (the static engine, step not
compiled), `static` (the static engine, compiled step: CUDA graphs on a GPU) and `hf-static` (transformers'
own `generate(cache_implementation="static")`, which compiles its forward on CUDA only). Each engine first
runs its warm-up (compilation, CUDA-graph recording), timed and printed apart; then rounds alternate the
engines so machine noise hits them alike, each round reseeding torch. Reports the median and range of tokens/s
(real completion tokens / wall time), each engine's ratio to `hf`, and on a GPU the ratio to the decode
roofline: every step reads all the weights once, so tokens/s <= rows * bandwidth / weight bytes (KV-cache
reads ignored). Rows sample at temperature 1 with EOS disabled, so every row generates the full budget and
all engines do the same work (`--eos model` keeps the model's EOS). Results go to
benchmarks/results/generation.{json,png}, one entry per mode.

    python benchmarks/generation.py --mode embedded --threads 1   # CPU: the shipped 0.3M policy, 64 x 64
    python benchmarks/generation.py --mode small --threads 1      # CPU: a random ~10M Qwen2, 32 x 128 tokens

On a GPU machine, from the repository root (results come back through $OUT):

    PYTHONPATH=. python benchmarks/generation.py --mode gpu && cp benchmarks/results/generation.* $OUT/

That is a random 1.5B-shaped Qwen2 in bf16, 128 rows x 256 tokens, an estimated 5 minutes on an H200, most
of it `hf` and two compilations (`--engines hf static` checks the target alone). `--bandwidth` sets the
memory bandwidth of the roofline (default: the H200's 4.8e12 B/s spec). On a CPU shared with other jobs pass
`--threads 1`: otherwise OpenMP threads waiting for busy cores dominate every engine's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from exgrpo_pl.data import ArithmeticTask
from exgrpo_pl.engines import Completions, HFEngine, SamplingConfig, StaticCacheEngine
from exgrpo_pl.engines.generation import completion_mask_from_ids
from exgrpo_pl.models import load_policy, load_tokenizer

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ENGINES = ("hf", "static-eager", "static", "hf-static")
H200_BANDWIDTH = 4.8e12
MODES = {
    "embedded": dict(rows=64, new_tokens=64, prompt_length=None, rounds=5),
    "small": dict(rows=32, new_tokens=128, prompt_length=32, rounds=5),
    "gpu": dict(rows=128, new_tokens=256, prompt_length=64, rounds=3),
}


def qwen2_config(mode: str) -> Qwen2Config:
    """A random Qwen2: ~10M parameters ("small"), or Qwen2.5-Math-1.5B's shape ("gpu")."""
    big = mode == "gpu"
    return Qwen2Config(
        vocab_size=151_936 if big else 16_384,
        hidden_size=1536 if big else 256,
        intermediate_size=8960 if big else 1024,
        num_hidden_layers=28 if big else 6,
        num_attention_heads=12 if big else 4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build(mode: str, rows: int, prompt_length: int | None, device: str):
    """The policy and `[rows, P]` left-padded prompts for `mode`."""
    generator = torch.Generator().manual_seed(0)
    if mode == "embedded":
        model = load_policy("embedded:tiny-arith")
        tokenizer = load_tokenizer("embedded:tiny-arith")
        prompts = [row["prompt"] for row in ArithmeticTask(rows, seed=0).rows()]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True)
        ids, mask = encoded["input_ids"], encoded["attention_mask"].bool()
    else:
        config = qwen2_config(mode)
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                config, dtype=torch.bfloat16 if mode == "gpu" else torch.float32, attn_implementation="sdpa"
            )
        ids = torch.randint(3, config.vocab_size, (rows, prompt_length), generator=generator)  # [N, P]
        lengths = torch.randint(prompt_length // 2, prompt_length + 1, (rows,), generator=generator)  # [N]
        mask = torch.arange(prompt_length) >= prompt_length - lengths[:, None]  # [N, P] left padding
        ids = ids.masked_fill(~mask, config.pad_token_id)
    return model.to(device).eval(), ids.to(device), mask.to(device)


class HFStatic:
    """transformers' `generate(cache_implementation="static")` as an engine (compiled on CUDA only)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, sampling: SamplingConfig) -> Completions:
        out = self.model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask.long(), do_sample=True,
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=0,
            max_new_tokens=sampling.max_new_tokens, pad_token_id=sampling.pad_token_id,
            eos_token_id=list(sampling.eos_token_ids), cache_implementation="static",
        )  # fmt: skip
        ids = out[:, prompt_ids.shape[1] :]  # [N, C]
        mask, truncated = completion_mask_from_ids(ids, list(sampling.eos_token_ids))
        return Completions(ids, mask, truncated)


def engine(name: str, model):
    if name == "hf":
        return HFEngine(model)
    if name == "hf-static":
        return HFStatic(model)
    return StaticCacheEngine(model, compile=name == "static")


def timed(run, device: str) -> tuple[float, int]:
    """Seconds and real completion tokens of one `run()`, the device drained before and after."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    completions = run()
    sync()
    return time.perf_counter() - start, int(completions.mask.sum())


def roofline(model, rows: int, bandwidth: float) -> float:
    """Decode tokens/s if each step only read the weights once at `bandwidth` B/s."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return rows * bandwidth / weight_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=tuple(MODES), default="embedded")
    parser.add_argument("--rows", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--prompt-length", type=int, help="random models: widest prompt (others shorter)")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--eos", choices=("none", "model"), default="none")
    parser.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH, help="GPU memory bandwidth, B/s")
    parser.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads); default: torch's")
    args = parser.parse_args()
    settings = {**MODES[args.mode], **{k: v for k, v in vars(args).items() if k in MODES["gpu"] and v}}
    device = "cuda" if args.mode == "gpu" else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--mode gpu needs CUDA; this machine has none (run --mode embedded or small)")
    model, ids, mask = build(args.mode, settings["rows"], settings["prompt_length"], device)
    vocab = model.config.vocab_size
    eos = (model.config.eos_token_id,) if args.eos == "model" else (vocab,)  # id `vocab` is never sampled
    sampling = SamplingConfig(settings["new_tokens"], 1.0, 1.0, model.config.pad_token_id, eos)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"{args.mode}: {parameters / 1e6:.1f}M parameters, {ids.shape[0]} rows x {sampling.max_new_tokens} "
        f"tokens, prompts {ids.shape[1]} wide, {device} ({torch.get_num_threads()} threads), "
        f"torch {torch.__version__}",
        flush=True,
    )

    engines = {name: engine(name, model) for name in args.engines}
    warmup = {}
    for name, eng in engines.items():
        compiled = name == "static" or (name == "hf-static" and device == "cuda")
        # Compiled engines warm up on the measured shape (compilation, CUDA-graph recording); the others on
        # a short budget (first-call allocations and kernel loading).
        warm = sampling if compiled else SamplingConfig(8, 1.0, 1.0, sampling.pad_token_id, eos)
        start = time.perf_counter()
        for _ in range(2 if compiled else 1):
            timed(lambda eng=eng, warm=warm: eng.generate(ids, mask, warm), device)
        warmup[name] = time.perf_counter() - start
        print(f"  warm-up {name:<13} {warmup[name]:7.1f} s", flush=True)

    rates = {name: [] for name in engines}
    for round_ in range(settings["rounds"]):
        for name, eng in engines.items():
            torch.manual_seed(round_)
            seconds, tokens = timed(lambda eng=eng: eng.generate(ids, mask, sampling), device)
            rates[name].append(tokens / seconds)
        print(
            f"  round {round_ + 1}: " + ", ".join(f"{n} {r[-1]:,.0f}" for n, r in rates.items()), flush=True
        )

    result = {
        "model_parameters": parameters, "rows": ids.shape[0], "new_tokens": sampling.max_new_tokens,
        "prompt_width": ids.shape[1], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "eos": args.eos, "engines": {},
    }  # fmt: skip
    if device == "cuda":
        result["bandwidth"] = args.bandwidth
        result["roofline_tokens_per_s"] = roofline(model, ids.shape[0], args.bandwidth)
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        print(
            f"roofline at {args.bandwidth / 1e12:.1f} TB/s "
            f"({'H200 spec, default' if args.bandwidth == H200_BANDWIDTH else '--bandwidth'}): "
            f">= {result['roofline_tokens_per_s']:,.0f} tokens/s (weights read once per step, KV ignored)"
        )
    reference = statistics.median(rates["hf"]) if "hf" in rates else None
    for name, values in rates.items():
        median = statistics.median(values)
        entry = {"tokens_per_s": values, "median": median, "min": min(values), "max": max(values),
                 "warmup_s": warmup[name]}  # fmt: skip
        line = f"{name:<13} {median:12,.0f} tokens/s  [{min(values):,.0f} - {max(values):,.0f}]"
        if reference:
            entry["ratio_to_hf"] = median / reference
            line += f"  {entry['ratio_to_hf']:6.2f}x hf"
        if device == "cuda":
            entry["roofline_share"] = median / result["roofline_tokens_per_s"]
            line += f"  {entry['roofline_share']:6.1%} of roofline"
        print(line + f"  (warm-up {warmup[name]:.1f} s)", flush=True)
        result["engines"][name] = entry

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "generation.json"
    everything = json.loads(path.read_text()) if path.exists() else {}
    everything[args.mode] = result
    path.write_text(json.dumps(everything, indent=1))
    _plot(everything, RESULTS / "generation.png")


def _plot(everything: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(everything), figsize=(4.5 * len(everything), 4), squeeze=False)
    for ax, (mode, result) in zip(axes[0], everything.items()):
        names = list(result["engines"])
        medians = [result["engines"][n]["median"] for n in names]
        errors = [
            [m - result["engines"][n]["min"] for n, m in zip(names, medians)],
            [result["engines"][n]["max"] - m for n, m in zip(names, medians)],
        ]
        bars = ax.bar(names, medians, yerr=errors, color="tab:blue", capsize=3)
        for bar, n in zip(bars, names):
            ratio = result["engines"][n].get("ratio_to_hf")
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x hf", (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2),
                            ha="center", color="white", fontsize=8)  # fmt: skip
        if "roofline_tokens_per_s" in result:
            ax.axhline(result["roofline_tokens_per_s"], color="tab:red", ls="--", label="decode roofline")
            ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{mode}: {result['model_parameters'] / 1e6:.1f}M params, {result['device']}\n"
                     f"{result['rows']} rows x {result['new_tokens']} tokens", fontsize=9)  # fmt: skip
        ax.set_ylabel("tokens/s (median, range)")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

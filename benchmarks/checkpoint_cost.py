"""What kill-proof checkpoints cost: the finite check and the completeness check, against a save and a load.

For Llama policies of ~5M and ~50M parameters (fp32, with Adam's two moments: a checkpoint of ~3x the
weights), times on this machine's CPU, median of --repeats:
  - finite check: `check_finite` over the state_dict (what AtomicCheckpointIO runs before every write), and
    the tensor-mask alternative `torch.isfinite(t).all()` it replaced;
  - saves: `save_atomically` (temp file beside the target, fsync, rename, fsync of the folder) and
    Lightning's `TorchCheckpointIO.save_checkpoint` (no fsync), into --dir;
  - integrity check: `record_reason` (what a resume runs on its checkpoint, and `ckpt_path="last"` on each
    candidate until one is intact: every record read and checked against its CRC-32), per GiB too, against
    `torch.load(mmap=True, weights_only=True)` and a full `torch.load`.

    python benchmarks/checkpoint_cost.py
    python benchmarks/checkpoint_cost.py --sizes 5 --repeats 3

Writes benchmarks/results/checkpoint_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from transformers import LlamaForCausalLM

from exgrpo_pl.checkpoints.integrity import record_reason
from exgrpo_pl.checkpoints.saving import check_finite, save_atomically
from exgrpo_pl.models import tiny_llama_config

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
SHAPES = {5: (256, 8), 50: (512, 20)}  # ~millions of parameters: (hidden size, layers)


def checkpoint_of(hidden: int, layers: int) -> dict:
    """A Lightning-shaped checkpoint of a Llama after one Adam step."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(32, hidden_size=hidden, num_layers=layers))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randint(0, 32, (2, 16)), labels=torch.randint(0, 32, (2, 16))).loss.backward()
    optimizer.step()
    return {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "global_step": 1}


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(megaparams: int, directory: str, repeats: int) -> dict:
    checkpoint = checkpoint_of(*SHAPES[megaparams])
    weights = checkpoint["state_dict"]
    path, lightning_path = os.path.join(directory, "a.ckpt"), os.path.join(directory, "b.ckpt")
    lightning = TorchCheckpointIO()
    figures = {
        "parameters": sum(t.numel() for t in weights.values()),
        "finite_check_s": timed(lambda: check_finite(weights, path), repeats),
        "isfinite_all_s": timed(lambda: all(bool(t.isfinite().all()) for t in weights.values()), repeats),
        "save_atomically_s": timed(lambda: save_atomically(checkpoint, path), repeats),
        "lightning_save_s": timed(lambda: lightning.save_checkpoint(checkpoint, lightning_path), repeats),
        "checkpoint_mb": os.path.getsize(path) / 2**20,
        "integrity_check_s": timed(lambda: record_reason(path), repeats),
        "mmap_weights_only_load_s": timed(lambda: torch.load(path, mmap=True, weights_only=True), repeats),
        "full_load_s": timed(lambda: torch.load(path, weights_only=True), repeats),
    }
    figures["finite_check_share_of_save"] = figures["finite_check_s"] / figures["save_atomically_s"]
    figures["integrity_check_s_per_gib"] = figures["integrity_check_s"] / (figures["checkpoint_mb"] / 1024)
    figures["integrity_check_share_of_load"] = figures["integrity_check_s"] / figures["full_load_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dir", default="/var/tmp", help="where the checkpoints are written (a disk)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the saves and checks run on rank 0's main thread
    directory = tempfile.mkdtemp(prefix="checkpoint_cost-", dir=args.dir)
    try:
        results = {f"{size}M": measure(size, directory, args.repeats) for size in args.sizes}
    finally:
        shutil.rmtree(directory)
    for name, figures in results.items():
        size = f"{figures['parameters'] / 1e6:.1f}M parameters, {figures['checkpoint_mb']:.0f} MB checkpoint"
        print(f"\n{name} ({size})")
        for key, value in figures.items():
            if key.endswith("_s"):
                print(f"  {key[:-2]:<26} {value * 1e3:9.2f} ms")
        print(f"  finite check / atomic save  {100 * figures['finite_check_share_of_save']:8.1f} %")
        print(f"  integrity check per GiB     {figures['integrity_check_s_per_gib']:8.2f} s")
        print(f"  integrity check / full load {100 * figures['integrity_check_share_of_load']:8.1f} %")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpoint_cost.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""What finding over-long prompts before training costs: `RolloutCollector.check_prompts` on a 46K-row
dataset (the size of OpenR1-Math's default split), with a byte-level BPE tokenizer trained here on the same
text (no hub: real models' tokenizers are fast BPE tokenizers like it).

    python benchmarks/prompt_check.py            # ~1 min on one CPU core

Prompts are synthetic math word problems of 150-900 characters. Prints seconds per dataset and per 1,000 rows.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from exgrpo_pl.rewards import ArithmeticReward
from exgrpo_pl.step.collect import RolloutCollector

RESULTS = Path(__file__).parent / "results"
WORDS = (
    "find the value of x such that sum of all integers between and where triangle area circle radius prove "
    "that for every positive real number let be a function satisfying compute remainder when divided by"
).split()


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(0, 10_000)) for _ in range(200)]
        out.append(" ".join(words)[: rng.randint(150, 900)])
    return out


def bpe_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<pad>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=46_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    texts = prompts(args.rows)
    rows = [{"id": i, "prompt": text} for i, text in enumerate(texts)]
    tokenizers = {"BPE (8K vocab)": bpe_tokenizer(texts[:5000])}
    results = {}
    for name, tokenizer in tokenizers.items():
        collector = RolloutCollector(tokenizer, [ArithmeticReward()], max_prompt_length=100_000)
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            collector.check_prompts(rows, "training data")
            seconds.append(time.perf_counter() - started)
        results[name] = {"rows": args.rows, "seconds": seconds, "median": statistics.median(seconds)}
        print(f"{name:24s} {args.rows} rows: {statistics.median(seconds):.2f} s "
              f"({1000 * statistics.median(seconds) / args.rows * 1000:.1f} ms per 1,000 rows)")  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "prompt_check.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Make the embedded policy `embedded:tiny-arith`: a tiny Llama, briefly fine-tuned on the synthetic task.

The quickstart needs a starting policy that is weak but not hopeless, so RL has something to improve and
something to build on: this script trains a 0.3M-parameter Llama with supervised next-token loss on the
answers for a short, fixed budget and stops well before it masters the task. Deterministic on CPU.

    python scripts/make_tiny_policy.py            # writes exgrpo_pl/assets/tiny-arith
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _sft import encode_examples, pass_at_1, save, supervised_warmup
from transformers import LlamaForCausalLM

from exgrpo_pl.data.synthetic import ARITHMETIC_ALPHABET, ArithmeticTask
from exgrpo_pl.models import ASSETS, build_char_tokenizer, tiny_llama_config
from exgrpo_pl.rewards import ArithmeticReward


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ASSETS / "tiny-arith")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-size", type=int, default=8000)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer(ARITHMETIC_ALPHABET)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer)))
    # Warm up on a larger pool of the same kind of questions, minus the quickstart's validation questions,
    # so that the quickstart's pass@1 measures questions the policy has never been taught.
    _, val_rows = ArithmeticTask(num_questions=2000, seed=0).split(0.1)
    held_out = {row["prompt"] for row in val_rows}
    pool = ArithmeticTask(num_questions=args.pool_size, seed=args.seed + 1).rows()
    train_rows = [row for row in pool if row["prompt"] not in held_out]
    inputs, labels = encode_examples(tokenizer, [(row["prompt"], row["answer"]) for row in train_rows])

    def evaluate(step: int, loss: float) -> bool:
        reward = ArithmeticReward()
        sampled, domains = pass_at_1(model, tokenizer, val_rows, reward, max_new_tokens=6)
        greedy, _ = pass_at_1(model, tokenizer, val_rows, reward, max_new_tokens=6, temperature=0.0)
        print(
            f"step {step} loss {loss:.3f}  val pass@1 sampled {sampled:.3f}, greedy {greedy:.3f}  {domains}",
            flush=True,
        )
        return False

    supervised_warmup(
        model, inputs, labels, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        eval_every=250, evaluate=evaluate,
    )  # fmt: skip
    save(model, tokenizer, args.out)


if __name__ == "__main__":
    main()

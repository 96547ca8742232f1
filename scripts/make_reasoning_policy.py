"""Make the embedded policy `embedded:tiny-reasoning`: a tiny Llama taught to write derivations of sums.

configs/quickstart_reasoning.yaml starts from it. Supervised warm-up on derivations of `ReasoningTask`
questions, as many of each family, each written in a random valid order, so the policy's right answers to
one question differ in text and in entropy; the validation questions of the config's task are left out.
Training stops at the first evaluation where the sampled (T = 1) validation pass@1, scored as the config
scores it (every step checked), reaches `--stop-at`: weak enough that RL has much to gain, strong enough
that most batches hold right answers. Deterministic on CPU.

    python scripts/make_reasoning_policy.py       # writes exgrpo_pl/assets/tiny-reasoning

The weaker `embedded:tiny-reasoning-weak` (benchmarks/learning.py's "weak_start" task) is the same warm-up
stopped at a tenth of the questions right (step 400 here, 0.112; the task's validation at T = 1 reads 0.089):
most groups of 8 still hold a right answer, so GRPO learns from the first step (0.22 after 50 steps), then
slowly: its validation pass@1 at T = 1 is still 0.33 after 200 steps (seed 0), below the paper's replay
trigger (a training batch's pass rate above 0.35), which the reasoning task's policy reaches in a few steps.

    python scripts/make_reasoning_policy.py --stop-at 0.1 --out exgrpo_pl/assets/tiny-reasoning-weak
"""

from __future__ import annotations

import argparse
import random
from collections import defaultdict
from pathlib import Path

import torch
from _sft import encode_examples, pass_at_1, save, supervised_warmup
from transformers import LlamaForCausalLM

from exgrpo_pl.data.reasoning import (
    MAX_DERIVATION_LENGTH,
    REASONING_ALPHABET,
    ReasoningTask,
    write_derivation,
)
from exgrpo_pl.models import ASSETS, build_char_tokenizer, tiny_llama_config
from exgrpo_pl.rewards import ReasoningReward


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ASSETS / "tiny-reasoning")
    parser.add_argument("--max-steps", type=int, default=4000)
    parser.add_argument("--stop-at", type=float, default=0.3, help="sampled val pass@1 that ends training")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-size", type=int, default=60000)
    parser.add_argument("--per-family", type=int, default=8000, help="derivations per family")
    parser.add_argument("--task-questions", type=int, default=20000, help="the config's task num_questions")
    parser.add_argument("--val-fraction", type=float, default=0.025, help="the config's data.val_fraction")
    args = parser.parse_args()

    # One thread: the same sums in the same order on any machine, and no threads waiting on each other when
    # the cores are shared.
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer(REASONING_ALPHABET)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), args.hidden_size, args.layers))
    _, val_rows = ReasoningTask(num_questions=args.task_questions, seed=0).split(args.val_fraction)
    held_out = {row["prompt"] for row in val_rows}
    by_family = defaultdict(list)
    for row in ReasoningTask(num_questions=args.pool_size, seed=args.seed + 1).rows():
        if row["prompt"] not in held_out:
            by_family[row["domain"]].append(row["prompt"])
    # As many derivations of each family, so the small one-digit families (100 to 3000 questions) are
    # taught as often as the large ones: their questions come back, each time in a fresh random order.
    rng = random.Random(args.seed)
    prompts = [rng.choice(family) for _, family in sorted(by_family.items()) for _ in range(args.per_family)]
    pairs = [(prompt, write_derivation(prompt, rng=rng)) for prompt in prompts]
    inputs, labels = encode_examples(tokenizer, pairs)
    reward = ReasoningReward(check_steps=True)
    print(
        f"{sum(p.numel() for p in model.parameters())} parameters, {len(pairs)} derivations of "
        f"{len(set(prompts))} questions",
        flush=True,
    )

    def evaluate(step: int, loss: float) -> bool:
        sampled, domains = pass_at_1(model, tokenizer, val_rows, reward, MAX_DERIVATION_LENGTH + 1)
        print(f"step {step} loss {loss:.3f}  val pass@1 sampled {sampled:.3f}  {domains}", flush=True)
        return sampled >= args.stop_at

    supervised_warmup(
        model, inputs, labels, steps=args.max_steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
        eval_every=args.eval_every, evaluate=evaluate,
    )  # fmt: skip
    save(model, tokenizer, args.out)


if __name__ == "__main__":
    main()

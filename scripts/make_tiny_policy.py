"""Make the embedded policy `embedded:tiny-arith`: a tiny Llama, briefly fine-tuned on the synthetic task.

The quickstart needs a starting policy that is weak but not hopeless, so RL has something to improve and
something to build on: this script trains a 0.3M-parameter Llama with supervised next-token loss on the
answers for a short, fixed budget and stops well before it masters the task. Deterministic on CPU.

    python scripts/make_tiny_policy.py            # writes exgrpo_pl/assets/tiny-arith
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from exgrpo_pl.batch import pad_sequences
from exgrpo_pl.data.synthetic import ARITHMETIC_ALPHABET, ArithmeticTask
from exgrpo_pl.models import ASSETS, build_char_tokenizer, tiny_llama_config
from exgrpo_pl.rewards import ArithmeticReward
from exgrpo_pl.rollout import sample_completions


def encode_examples(tokenizer, rows):
    """prompt + answer + EOS, with labels only on the answer and EOS (the prompt is given, not learned)."""
    inputs, labels = [], []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        answer = tokenizer(row["answer"])["input_ids"] + [tokenizer.eos_token_id]
        inputs.append(torch.tensor(prompt + answer))
        labels.append(torch.tensor([-100] * len(prompt) + answer))
    return inputs, labels


@torch.no_grad()
def pass_at_1(model, tokenizer, rows, temperature=1.0):
    """Share of rows answered correctly by one sampled completion, overall and per domain."""
    prompt_ids, prompt_mask = pad_sequences(
        [torch.tensor(tokenizer(r["prompt"])["input_ids"]) for r in rows], left=True, pad_value=0
    )
    completion_ids, _, _ = sample_completions(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=6,
        temperature=temperature,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    scores = ArithmeticReward()([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows])
    by_domain = defaultdict(list)
    for row, score in zip(rows, scores):
        by_domain[row["domain"]].append(score)
    overall = sum(scores) / len(scores)
    return overall, {d: round(sum(s) / len(s), 2) for d, s in sorted(by_domain.items())}


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
    inputs, labels = encode_examples(tokenizer, train_rows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed)
    for step in range(1, args.steps + 1):
        index = torch.randint(len(inputs), (args.batch_size,), generator=generator).tolist()
        ids, mask = pad_sequences([inputs[i] for i in index], left=False, pad_value=0)
        target, _ = pad_sequences([labels[i] for i in index], left=False, pad_value=-100)
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=target).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 250 == 0 or step == args.steps:
            model.eval()
            sampled, domains = pass_at_1(model, tokenizer, val_rows)
            greedy, _ = pass_at_1(model, tokenizer, val_rows, temperature=0.0)
            model.train()
            print(
                f"step {step} loss {loss.item():.3f}  val pass@1 sampled {sampled:.3f}, greedy {greedy:.3f}"
                f"  {domains}",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()

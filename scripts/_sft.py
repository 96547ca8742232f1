"""What the scripts making the embedded policies share: encoding, supervised warm-up, sampled pass@1, saving.

Imported by `make_tiny_policy.py` and `make_reasoning_policy.py`, which run from this directory.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from exgrpo_pl.batch import pad_sequences
from exgrpo_pl.engines.generation import sample_completions


def encode_examples(
    tokenizer, pairs: Iterable[tuple[str, str]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """prompt + target + EOS, with labels only on the target and EOS (the prompt is given, not learned).

    Args:
        tokenizer: the policy's tokenizer.
        pairs: `(prompt, target)` texts.

    Returns:
        `(inputs, labels)`: one `[L]` tensor each per pair, labels -100 on the prompt.
    """
    inputs, labels = [], []
    for prompt_text, target_text in pairs:
        prompt = tokenizer(prompt_text)["input_ids"]
        target = tokenizer(target_text)["input_ids"] + [tokenizer.eos_token_id]
        inputs.append(torch.tensor(prompt + target))
        labels.append(torch.tensor([-100] * len(prompt) + target))
    return inputs, labels


@torch.no_grad()
def pass_at_1(model, tokenizer, rows, reward, max_new_tokens: int, temperature: float = 1.0):
    """Share of rows answered correctly by one sampled completion, overall and per domain.

    Args:
        model: the policy, in eval mode.
        tokenizer: its tokenizer.
        rows: task rows with `prompt`, `answer` and `domain`.
        reward: a verifier following the TRL reward protocol.
        max_new_tokens: completion length limit, EOS included.
        temperature: sampling temperature; 0 is greedy.

    Returns:
        `(overall, {domain: pass@1 rounded to 2 places})`.
    """
    prompt_ids, prompt_mask = pad_sequences(
        [torch.tensor(tokenizer(r["prompt"])["input_ids"]) for r in rows], left=True, pad_value=0
    )
    completion_ids, _, _ = sample_completions(
        model,
        prompt_ids,
        prompt_mask,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    scores = reward([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows])
    by_domain = defaultdict(list)
    for row, score in zip(rows, scores):
        by_domain[row["domain"]].append(score)
    overall = sum(scores) / len(scores)
    return overall, {d: round(sum(s) / len(s), 2) for d, s in sorted(by_domain.items())}


def supervised_warmup(
    model,
    inputs: list[torch.Tensor],
    labels: list[torch.Tensor],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    eval_every: int,
    evaluate: Callable[[int, float], bool],
) -> int:
    """Next-token training on examples drawn uniformly with replacement, with AdamW.

    Args:
        model: the policy to train, in place.
        inputs: `encode_examples` inputs.
        labels: `encode_examples` labels.
        steps: the most optimizer steps to take.
        batch_size: examples per step.
        lr: AdamW learning rate.
        seed: seeds the draw of examples.
        eval_every: call `evaluate` every this many steps and after the last.
        evaluate: `(step, loss) -> stop`, called in eval mode; returning True ends training there.

    Returns:
        The number of steps taken.
    """
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        index = torch.randint(len(inputs), (batch_size,), generator=generator).tolist()
        ids, mask = pad_sequences([inputs[i] for i in index], left=False, pad_value=0)
        target, _ = pad_sequences([labels[i] for i in index], left=False, pad_value=-100)
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=target).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % eval_every == 0 or step == steps:
            model.eval()
            stop = evaluate(step, loss.item())
            model.train()
            if stop:
                return step
    return steps


def save(model, tokenizer, out: Path) -> None:
    """Writes the model (config, weights, generation config) and tokenizer so `from_pretrained` reads them."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved to {out}")

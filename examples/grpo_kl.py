"""A plain GRPO LightningModule as many are written: automatic optimisation, K completions per prompt sampled
inline with `generate(num_return_sequences=K)`, `[B, K]` reshapes, its own advantages, and a KL penalty to a
frozen reference model.

examples/own_module_kl.py is this module made replay-ready (mix and swap); `diff examples/grpo_kl.py
examples/own_module_kl.py` shows every line that changes, and docs/replay_contract.md walks through them.

    python examples/grpo_kl.py
    python examples/own_module_kl.py --mode mix    (or --mode swap)
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.models import resolve_model_path
from exgrpo_pl.rewards import ArithmeticReward


class GRPO(LightningModule):
    """K sampled completions per prompt, group-normalised advantages, a clipped loss plus beta * KL."""

    def __init__(self, model: str = "embedded:tiny-arith", num_generations: int = 4, max_new_tokens: int = 6,
                 learning_rate: float = 5e-4, epsilon: float = 0.2, beta: float = 0.04) -> None:  # fmt: skip
        super().__init__()
        self.num_generations, self.max_new_tokens = num_generations, max_new_tokens
        self.learning_rate, self.epsilon, self.beta = learning_rate, epsilon, beta
        self.temperature = 0.9
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model))
        self.reference = AutoModelForCausalLM.from_pretrained(resolve_model_path(model)).requires_grad_(False)
        self.reward_fn = ArithmeticReward()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """`[B, K]` -> `[B, K]`: each reward minus its group's mean, over the group's std."""
        return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-8)

    def forward_logps(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        """`[N, C]` log-probs of the completion tokens at the sampling temperature, and `[N, C, V]` logits."""
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1).long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate() counts them on left-padded prompts
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, prompt_ids.shape[1] - 1 : -1] / self.temperature  # [N, C, V]
        return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), logits

    def training_step(self, batch: dict, batch_idx: int):
        k = self.num_generations
        with torch.no_grad():
            encoded = self.tokenizer(batch["prompt"], return_tensors="pt", padding=True).to(self.device)
            out = self.model.generate(
                **encoded, do_sample=True, top_k=0, temperature=self.temperature, num_return_sequences=k,
                max_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
            )  # fmt: skip
        prompt_ids = encoded.input_ids.repeat_interleave(k, 0)  # [N, P], N = B * K
        prompt_mask = encoded.attention_mask.repeat_interleave(k, 0)
        completion_ids = out[:, prompt_ids.shape[1] :]  # [N, C]
        is_eos = completion_ids == self.tokenizer.eos_token_id
        completion_mask = is_eos.cumsum(1) - is_eos.long() == 0  # [N, C] up to and including the first EOS
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [p for p in batch["prompt"] for _ in range(k)]
        answers = [a for a in batch["answer"] for _ in range(k)]
        rewards = torch.tensor(self.reward_fn(prompts, completions, answer=answers), device=self.device)
        advantages = self.advantages(rewards.view(-1, k))  # [B, K]
        sequences = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        logps, logits = self.forward_logps(self.model, *sequences)  # [N, C], [N, C, V]
        with torch.no_grad():
            reference_logps, _ = self.forward_logps(self.reference, *sequences)  # [N, C]
        ratio = torch.exp(logps - logps.detach())  # one update per batch: 1, with the policy gradient
        adv = advantages.reshape(-1, 1)  # [N, 1]
        eps = self.epsilon
        policy_gradient = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)  # [N, C]
        log_ratio = reference_logps - logps  # [N, C]
        kl = torch.exp(log_ratio) - log_ratio - 1  # [N, C] the k3 estimator of KL(policy || reference)
        per_token = policy_gradient + self.beta * kl
        token_mask = completion_mask.float()
        per_row = (per_token * token_mask).sum(1) / token_mask.sum(1).clamp(min=1)  # [N]
        loss = per_row.view(-1, k).mean(1).mean()  # [B, K] -> [B] -> a mean over questions
        self.log("reward", rewards.view(-1, k).mean(), prog_bar=True, batch_size=len(rewards))
        self.log("kl", (kl * token_mask).sum() / token_mask.sum().clamp(min=1), batch_size=len(rewards))
        return loss


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    args = parser.parse_args(argv)
    seed_everything(0)
    trainer = Trainer(max_steps=args.max_steps, accelerator="cpu", limit_val_batches=0, logger=False,
                      enable_checkpointing=False)  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=500), batch_size=args.batch_size)
    trainer.fit(GRPO(), data)
    return trainer


if __name__ == "__main__":
    main()

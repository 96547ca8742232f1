"""A GRPO LightningModule written the way TRL-style trainers are, plain and made replay-ready, for the tests
of adopting replay in a module written elsewhere (tests/module/test_trl_style_adoption.py).

The plain module (`PlainGRPO`) has what such modules have and the shipped examples do not: its own plain
torch `DataLoader` (`train_dataloader`, shuffled, no datamodule), automatic optimisation, K samples per prompt
with `num_return_sequences`, advantages from a method of its own named `_compute_advantages` (eps 1e-6, not
the hook's name), TRL-style reward functions (`fn(completions, **columns) -> list[float]`) scored AFTER the
policy forward, their per-function means logged as `rewards/<name>`, and a k3 KL to a frozen reference.

`ReplayReadyGRPO` is that module made replay-ready as the docs say: the sampling and the scoring move into
`rollout` (one completion per prompt, the per-function rewards returned by name), and `training_step` takes
its groups from `replay_groups`, its own advantages passed explicitly. Subclasses in the tests break it in
the ways a user does.
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_pl.data import ArithmeticTask, collate_rows
from exgrpo_pl.module import ReplayMixin


def digits_reward(completions, **columns):
    """1.0 for a completion that starts with a digit."""
    return [1.0 if c[:1].isdigit() else 0.0 for c in completions]


def short_reward(completions, **columns):
    """0.5 for a completion of at most 2 characters."""
    return [0.5 if len(c) <= 2 else 0.0 for c in completions]


def accuracy_reward(completions, answer, **columns):
    """1.0 for the reference answer, zipped strictly as open-r1's reward functions pair their columns."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


class PlainGRPO(LightningModule):
    """K completions per prompt, rewards scored after the forward, its own advantages, clipped loss + KL."""

    def __init__(self, model_dir: str, num_generations: int = 4, batch_size: int = 4) -> None:
        super().__init__()
        self.num_generations, self.max_new_tokens, self.batch_size = num_generations, 4, batch_size
        self.learning_rate, self.beta, self.epsilon = 1e-3, 0.04, 0.2
        self.temperature = 1.0
        self.rows = ArithmeticTask(num_questions=64, seed=1).rows()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.reference = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
        self.reward_funcs = [digits_reward, short_reward, accuracy_reward]

    def train_dataloader(self):
        return DataLoader(self.rows, batch_size=self.batch_size, shuffle=True, collate_fn=collate_rows)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate)

    def _compute_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """`[B, K]` -> `[B, K]`, eps 1e-6."""
        return (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)

    def forward_logps(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1).long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, prompt_ids.shape[1] - 1 : -1] / self.temperature  # [N, C, V]
        return torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1), logits

    def generate(self, prompts: list[str], k: int):
        """`k` completions of each prompt: ids and masks (up to and including the first EOS), texts."""
        with torch.no_grad():
            encoded = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.device)
            out = self.model.generate(
                **encoded, do_sample=True, top_k=0, temperature=self.temperature, num_return_sequences=k,
                max_new_tokens=self.max_new_tokens, pad_token_id=self.tokenizer.pad_token_id,
            )  # fmt: skip
        prompt_ids = encoded.input_ids.repeat_interleave(k, 0)  # [N, P]
        prompt_mask = encoded.attention_mask.repeat_interleave(k, 0)
        completion_ids = out[:, prompt_ids.shape[1] :]  # [N, C]
        is_eos = completion_ids == self.tokenizer.eos_token_id
        completion_mask = is_eos.cumsum(1) - is_eos.long() == 0
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return prompt_ids, prompt_mask, completion_ids, completion_mask, texts

    def score(self, completions: list[str], **columns) -> dict[str, torch.Tensor]:
        """Each reward function's `[N]` rewards, by name."""
        device = self.device
        return {fn.__name__: torch.tensor(fn(completions, **columns)).to(device) for fn in self.reward_funcs}

    def loss(self, sequences, logps, advantages, k):
        with torch.no_grad():
            reference_logps, _ = self.forward_logps(self.reference, *sequences)
        ratio = torch.exp(logps - logps.detach())
        adv = advantages.reshape(-1, 1)
        pg = -torch.min(ratio * adv, ratio.clamp(1 - self.epsilon, 1 + self.epsilon) * adv)  # [N, C]
        return pg, reference_logps

    def reduce(self, per_token, completion_mask, k):
        mask = completion_mask.float()
        per_row = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # [N]
        return per_row.view(-1, k).mean(1).mean()

    def kl(self, reference_logps, logps):
        log_ratio = reference_logps - logps
        return torch.exp(log_ratio) - log_ratio - 1  # [N, C]

    def training_step(self, batch, batch_idx):
        k = self.num_generations
        *sequences, texts = self.generate(batch["prompt"], k)
        logps, _ = self.forward_logps(self.model, *sequences)
        answers = [a for a in batch["answer"] for _ in range(k)]
        parts = self.score(texts, answer=answers)  # scored after the forward
        rewards = sum(parts.values())
        advantages = self._compute_advantages(rewards.view(-1, k))
        pg, reference_logps = self.loss(sequences, logps, advantages, k)
        per_token = pg + self.beta * self.kl(reference_logps, logps)
        for name, values in parts.items():
            self.log(f"rewards/{name}", values.float().mean(), batch_size=len(values))
        return self.reduce(per_token, sequences[3], k)


class ReplayReadyGRPO(ReplayMixin, PlainGRPO):
    """The plain module made replay-ready: sampling and scoring in `rollout`, groups from `replay_groups`."""

    replay_placements = ("displace", "join", "refill")

    def rollout(self, prompts: list[str], **columns):
        *sequences, texts = self.generate(prompts, 1)
        return (*sequences, self.score(texts, **columns))

    def groups(self, batch):
        return self.replay_groups(batch, self.rollout, advantages=self._compute_advantages)

    def training_step(self, batch, batch_idx):
        rollouts = self.groups(batch)
        sequences, k = rollouts.sequences, rollouts.group_size
        logps, logits = self.forward_logps(self.model, *sequences)
        self.record_behaviour(rollouts, logps, logits)
        pg, reference_logps = self.loss(sequences, logps, rollouts.advantages, k)
        pg = self.replay_loss(pg, logps, rollouts)
        per_token = pg + self.beta * self.kl(reference_logps, logps)
        loss = self.reduce(per_token, rollouts.completion_mask, k)
        return {"loss": loss, "rollouts": rollouts, "gave_way": self.replay_gave_way}

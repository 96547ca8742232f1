"""A plain GRPO LightningModule with its sampling inline in `training_step`, and the same module made ready
for `ReplayCallback`.

examples/grpo_inline.py is the plain module (no replay); examples/own_module_inline.py is that module made
replay-ready. `diff examples/grpo_inline.py examples/own_module_inline.py` shows every line that changes: the
sampling moves into a function that samples one completion per prompt it is given (`replay_groups` decides
how often each question is sampled: K times, K-1 for a replayed one, not at all in swap mode), the
advantages come with the groups, and `record_behaviour`, `replay_loss` and the returned rollouts are added.

    python examples/grpo_inline.py
    python examples/own_module_inline.py
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.models import resolve_model_path
from exgrpo_pl.module import ReplayMixin
from exgrpo_pl.rewards import ArithmeticReward


class GRPO(ReplayMixin, LightningModule):
    """K sampled completions per prompt, rewards, group-normalised advantages, one clipped update a batch."""

    def __init__(self, model: str = "embedded:tiny-arith", num_generations: int = 4, max_new_tokens: int = 6,
                 learning_rate: float = 5e-4, epsilon: float = 0.2) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.num_generations = num_generations
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(resolve_model_path(model))
        self.reward_fn = ArithmeticReward()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.learning_rate)

    def rollout(self, prompts: list[str], **columns):
        # Sample one completion per prompt and score it.
        with torch.no_grad():
            encoded = self.tokenizer(prompts, return_tensors="pt", padding=True).to(self.device)
            out = self.model.generate(
                **encoded, do_sample=True, top_k=0, max_new_tokens=self.hparams.max_new_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
            )  # fmt: skip
        completion_ids = out[:, encoded.input_ids.shape[1] :]  # [N, C]
        is_eos = completion_ids == self.tokenizer.eos_token_id
        completion_mask = is_eos.cumsum(1) - is_eos.long() == 0  # [N, C] up to and including the first EOS
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        rewards = torch.tensor(self.reward_fn(prompts, completions, **columns), device=self.device)
        return encoded.input_ids, encoded.attention_mask, completion_ids, completion_mask, rewards

    def training_step(self, batch: dict, batch_idx: int):
        rollouts = self.replay_groups(batch, self.rollout, advantages="group")  # K each (K-1 if replayed)
        prompt_ids, prompt_mask, completion_ids, completion_mask = rollouts.sequences
        advantages = rollouts.advantages  # "group": the library's, which were this module's (eps 1e-4)
        # One clipped update.
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1).long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate() counts them on left-padded prompts
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[:, prompt_ids.shape[1] - 1 : -1]  # [N, C, V] the logits that predicted the completion
        logps = torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)  # [N, C]
        self.record_behaviour(rollouts, logps, logits)
        ratio = torch.exp(logps - logps.detach())  # one update per batch: 1, with the policy gradient
        adv = advantages.reshape(-1, 1)  # [N, 1]
        eps = self.hparams.epsilon
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)  # [N, C]
        per_token = self.replay_loss(per_token, logps, rollouts)
        token_mask = completion_mask.float()
        loss = (per_token * token_mask).sum() / token_mask.sum().clamp(min=1)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        if len(fresh := self.fresh_rows(rollouts)):  # the policy's own samples (none on a swap step)
            self.log("reward", fresh.rewards.mean(), prog_bar=True, batch_size=len(fresh))
        return {"loss": loss, "rollouts": rollouts}


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    args = parser.parse_args(argv)
    seed_everything(0)
    trainer = Trainer(max_steps=args.max_steps, accelerator="cpu", limit_val_batches=0, logger=False,
                      enable_checkpointing=False,
                      callbacks=[ReplayCallback(mode="mix", min_buffer_size=64)])  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=500), batch_size=args.batch_size)
    trainer.fit(GRPO(), data)
    return trainer


if __name__ == "__main__":
    main()

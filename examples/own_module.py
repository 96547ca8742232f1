"""A GRPO LightningModule as a user writes it, made ready for `ReplayCallback` by the lines marked `# replay`.

The module is plain GRPO: manual optimisation, `model.generate`, its own rewards, group advantages and
clipped token loss. The marked lines make it ExGRPO: `ReplayMixin` gives it the contract's members and
helpers; `replay_groups` calls the module's own sampler for what the batch needs (every question K times,
or, when the callback put experience in the batch, the fresh questions K times and each replayed one K-1
times, or nothing in swap mode) and returns the groups with their advantages (`advantages="group"`: the
library's group-normalised ones, which are this module's; a module with a definition of its own passes that
method); `record_behaviour` keeps the first forward's log-probs and entropy for the buffer; `replay_loss`
weights the replayed rows' tokens by importance weights with policy shaping; the step returns what it
trained on. Without the callback it trains plain GRPO, as before. The reward it logs is the fresh rows'
(the policy's own samples), not the stored rows' it replays.

With `replay_placements` declaring "refill", `replay_groups` also fills the places of groups whose K rewards
came out all equal with stored questions, K-1 new rollouts each, and the step returns the groups that gave
way (`self.replay_gave_way`) for the callback's difficulty counts.

    python examples/own_module.py
    python examples/own_module.py --placement refill
"""

from __future__ import annotations

import argparse

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from exgrpo_pl.callbacks import ReplayCallback  # replay
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.models import resolve_model_path
from exgrpo_pl.module import ReplayMixin  # replay
from exgrpo_pl.rewards import ArithmeticReward


class GRPO(ReplayMixin, LightningModule):  # replay
    """K sampled completions per prompt, rewards, group-normalised advantages, one clipped update a batch."""

    replay_placements = ("displace", "join", "refill")  # refill: replay_groups fills dead groups' places

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

    @torch.no_grad()
    def rollout(self, prompts: list[str], **columns) -> tuple[Tensor, ...]:
        """Sample one completion per prompt and score it: prompt/completion ids and masks, rewards."""
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

    def completion_logits(self, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                          completion_mask: Tensor) -> Tensor:  # fmt: skip
        """`[N, C, V]` logits that predicted each completion token."""
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1).long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)  # as generate() counts them on left-padded prompts
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        return logits[:, prompt_ids.shape[1] - 1 : -1]

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        rollouts = self.replay_groups(batch, self.rollout, advantages="group")  # replay
        prompt_ids, prompt_mask, completion_ids, completion_mask = rollouts.sequences  # replay
        advantages = rollouts.advantages  # replay
        logits = self.completion_logits(prompt_ids, prompt_mask, completion_ids, completion_mask)
        logps = torch.log_softmax(logits, -1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)  # [N, C]
        self.record_behaviour(rollouts, logps, logits)  # replay
        ratio = torch.exp(logps - logps.detach())  # one update per batch: 1, with the policy gradient
        adv = advantages.reshape(-1, 1)  # [N, 1]
        eps = self.hparams.epsilon
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)  # [N, C]
        per_token = self.replay_loss(per_token, logps, rollouts)  # replay
        mask = completion_mask.float()
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        if len(fresh := self.fresh_rows(rollouts)):  # the policy's own samples (none on a swap step)
            self.log("reward", fresh.rewards.mean(), prog_bar=True, batch_size=len(fresh))
        return {"loss": loss, "rollouts": rollouts, "gave_way": self.replay_gave_way}  # replay


class StepLog(Callback):
    """Per training step: the mean reward of the fresh rollouts (the policy's own samples) and the number of
    rows that came out of the replay buffer."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.replayed: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        rollouts = outputs["rollouts"]
        self.rewards.append(rollouts.rewards[~rollouts.replayed].mean().item())
        self.replayed.append(int(rollouts.replayed.sum()))

    def summary(self, window: int = 5) -> str:
        """How many steps replayed, and the fresh rollouts' reward over the first and last `window` steps."""
        steps, replay_steps = len(self.rewards), sum(n > 0 for n in self.replayed)
        window = max(1, min(window, steps // 2))
        first, last = self.rewards[:window], self.rewards[-window:]
        note = "" if replay_steps else " (replay starts once the buffer holds min_buffer_size trajectories)"
        return (
            f"replay: {replay_steps} of {steps} steps trained on stored trajectories, "
            f"{sum(self.replayed)} in all{note}\n"
            f"reward of fresh rollouts: {sum(first) / len(first):.3f} over steps 1-{window}, "
            f"{sum(last) / len(last):.3f} over steps {steps - window + 1}-{steps}"
        )


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per step")
    parser.add_argument("--placement", choices=["displace", "join", "refill"], default="displace")
    args = parser.parse_args(argv)
    seed_everything(0)
    log = StepLog()
    replay = ReplayCallback(mode="mix", min_buffer_size=64, placement=args.placement)  # replay
    trainer = Trainer(max_steps=args.max_steps, accelerator="cpu", limit_val_batches=0, logger=False,
                      enable_checkpointing=False, callbacks=[log, replay])  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=500), batch_size=args.batch_size)
    trainer.fit(GRPO(), data)
    print(log.summary())
    return trainer


if __name__ == "__main__":
    main()

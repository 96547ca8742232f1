"""ExGRPOModule(dynamic_sampling=...) under 2-process DDP on CPU (gloo): every rank takes as many generation
rounds at each step (the rounds are collective under ZeRO-3), refill fills as many places on every rank (the
fewest any rank has), and the ranks' streams move on together, each through its own share of the pass."""

import json

import pytest
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.data import ArithmeticTask, PromptDataModule

pytestmark = pytest.mark.multiprocess

ROWS, BATCH, K = 200, 4, 4  # 100 questions a rank: the pass outlasts the test


def rank_dependent_reward(prompts, completions, trainer_state, **columns):
    """Rank 0: whether a completion starts with a digit (its groups differ); rank 1: 1.0 for every
    completion, so every group is dead there and that rank alone would always take every round."""
    if trainer_state.is_world_process_zero:
        return [float(completion[:1].isdigit()) for completion in completions]
    return [1.0] * len(completions)


class SaveSteps(Callback):
    """Per step on this rank: (generation rounds, dead groups before, groups that gave way), and the
    questions it trained on."""

    def __init__(self, root):
        self.root, self.steps, self.questions = root, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics, gave_way = pl_module.last_step_metrics, outputs["gave_way"]
        gave = 0 if gave_way is None else len(gave_way) // K
        rounds = int(metrics["train/generation_rounds"])
        self.steps.append((rounds, int(metrics["train/dead_groups_before"]), gave))
        self.questions += outputs["rollouts"].question_ids.view(-1, K)[:, 0].tolist()

    def on_train_end(self, trainer, pl_module):
        path = self.root / f"rank{trainer.global_rank}.json"
        path.write_text(json.dumps({"steps": self.steps, "questions": self.questions}))


def fit_two_ranks(root, model_dir, **options):
    seed_everything(0)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=5, logger=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=root, callbacks=[SaveSteps(root)],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
    module = tiny_module(
        model_dir, num_generations=K, max_completion_length=3, reward_funcs=[rank_dependent_reward], **options
    )
    trainer.fit(module, datamodule=data)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


def test_dapo_takes_as_many_rounds_on_every_rank(tmp_path, tiny_model_dir):
    ranks = fit_two_ranks(tmp_path, tiny_model_dir, dynamic_sampling="dapo", max_generation_rounds=3)
    rounds = [[step[0] for step in rank["steps"]] for rank in ranks]
    assert rounds[0] == rounds[1] == [3] * 5  # rank 1's dead groups keep every rank going to the cap
    assert all(step[1] < BATCH for step in ranks[0]["steps"])  # rank 0 alone would have stopped sooner
    # Each rank trains on questions of its own share of the pass: none on both.
    assert not set(ranks[0]["questions"]) & set(ranks[1]["questions"])


def test_refill_fills_as_many_places_on_every_rank_the_fewest_any_rank_has(tmp_path, tiny_model_dir):
    ranks = fit_two_ranks(tmp_path, tiny_model_dir, dynamic_sampling="refill")
    filled = [[step[2] for step in rank["steps"]] for rank in ranks]
    dead = [[step[1] for step in rank["steps"]] for rank in ranks]
    assert filled[0] == filled[1] == [min(a, b) for a, b in zip(*dead)] and any(filled[0])
    assert dead[1] == [BATCH] * 5 and dead[0] != dead[1]

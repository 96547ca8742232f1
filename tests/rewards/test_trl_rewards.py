"""TRL's own reward functions, unchanged, in real runs with ReplayCallback: a replayed question's fresh
rollouts are scored with its own dataset columns (`solution`, `extra_info`), and every row's reward is what
TRL's functions compute for its completion.

The dataset is conversational, as `accuracy_reward` and `think_format_reward` read completions the way TRL
gives them for message prompts (`completion[0]["content"]`). The tiny char-level model never writes LaTeX or
`<think>`, so scores are 0, or None (accuracy) where a row's solution has no parseable answer: the test checks
which columns each row was scored with and the equality of scores, not learning. Marked slow: TRL comes
with the `bench` extra, which the slow CI step installs.
"""

import json

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.experience import SelectiveReplay

trl = pytest.importorskip("trl.rewards")
pytest.importorskip("math_verify")  # accuracy_reward's verifier (the `math` extra)
trl_accuracy_reward, think_format_reward = trl.accuracy_reward, trl.think_format_reward

pytestmark = pytest.mark.slow

K = 4
WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split()
)


def write_dataset(path):
    """16 questions "a+b=" as user messages, each with its own `solution` (every third unparseable, so that
    `accuracy_reward` returns None there) and an `extra_info` dict, as verl rows carry."""
    with path.open("w") as file:
        for i in range(16):
            a, b = divmod(37 * i + 11, 10)
            solution = (
                f"no gold answer for row {WORDS[i]}" if i % 3 == 0 else f"$\\frac{{{a + b}}}{{{i + 2}}}$"
            )
            row = {
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "answer": str(a + b),
                "solution": solution,
                "extra_info": {"index": i, "split": "train"},
            }
            file.write(json.dumps(row) + "\n")


class Rollouts(Callback):
    """What every training step trained on."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(outputs["rollouts"])


def run(tmp_path, model_dir, mode):
    """A 4-step run on the dataset, replaying from the second step; returns (accuracy_reward's calls, the
    steps' rollouts, question id -> dataset row)."""
    calls = []

    def accuracy_reward(completions, solution, **kwargs):  # TRL's, recording what it is given
        calls.append({"completions": completions, "solution": solution, **kwargs})
        return trl_accuracy_reward(completions, solution, **kwargs)

    path = tmp_path / f"train_{mode}.jsonl"
    write_dataset(path)
    seed_everything(0)
    module = tiny_module(model_dir, reward_funcs=[accuracy_reward, think_format_reward], num_generations=K)
    data = PromptDataModule(train_path=str(path), batch_size=4, val_fraction=0.0)
    replay = ReplayCallback(
        mode=mode, replay=SelectiveReplay("uniform", replay_probability=1.0), min_buffer_size=1
    )
    rollouts = Rollouts()
    trainer = Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, callbacks=[replay, rollouts],
        default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert replay.replayed_steps == 3
    return calls, rollouts.steps, {row["id"]: row for row in data.train_rows}


def trl_rewards(completions, solutions):
    """`[N]` what TRL's GRPOTrainer totals for these completions (texts) and solutions: each function's
    scores, None as NaN, summed over the functions with NaN left out (weights 1)."""
    conversational = [[{"role": "assistant", "content": text}] for text in completions]
    accuracy = trl_accuracy_reward(conversational, solutions)
    per_function = torch.tensor(
        [[torch.nan if a is None else a for a in accuracy], think_format_reward(conversational)],
        dtype=torch.float32,
    ).T  # [N, 2]
    return per_function.nansum(dim=1)


def test_mix_mode_scores_a_replayed_questions_rollouts_with_its_own_solution(tmp_path, tiny_model_dir):
    calls, steps, rows = run(tmp_path, tiny_model_dir, "mix")
    key = lambda prompt: json.dumps(prompt, sort_keys=True)  # noqa: E731 (a message list, hashable)
    by_prompt = {key(row["prompt"]): row for row in rows.values()}
    assert len(calls) == len(steps) == 4  # one scoring call per step: every step generated
    replayed_rows = 0
    for call, step in zip(calls, steps):
        replayed = {key(rows[q]["prompt"]) for q in step.question_ids[step.replayed].tolist()}
        for i, prompt in enumerate(call["prompts"]):
            row = by_prompt[key(prompt)]
            # Every column as the dataset holds it, for fresh and replayed questions alike.
            assert call["solution"][i] == row["solution"]
            assert call["extra_info"][i] == row["extra_info"] and call["answer"][i] == row["answer"]
            replayed_rows += key(prompt) in replayed
        # The step's rows, the stored ones included: each reward is TRL's for its completion and solution.
        solutions = [rows[q]["solution"] for q in step.question_ids.tolist()]
        assert torch.equal(step.rewards.cpu(), trl_rewards(step.completions, solutions))
    assert replayed_rows == 3 * 2 * (K - 1)  # 3 replay steps, 2 replayed questions, K-1 fresh rollouts each
    scores = [s for call in calls for s in trl_accuracy_reward(call["completions"], call["solution"])]
    assert None in scores  # an unparseable solution's rows: left out of the sum, as TRL does


def test_swap_mode_rows_carry_their_columns_and_the_rewards_they_were_scored_with(tmp_path, tiny_model_dir):
    calls, steps, rows = run(tmp_path, tiny_model_dir, "swap")
    assert len(calls) == 1  # only the first, on-policy step scored anything
    for step in steps[1:]:
        assert step.replayed.all() and step.columns is not None
        questions = step.question_ids.tolist()
        assert step.columns["solution"] == [rows[q]["solution"] for q in questions]
        assert step.columns["extra_info"] == [rows[q]["extra_info"] for q in questions]
        assert torch.equal(step.rewards.cpu(), trl_rewards(step.completions, step.columns["solution"]))

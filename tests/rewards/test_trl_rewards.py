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
from pathlib import Path

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import reward_name

trl = pytest.importorskip("trl.rewards")
pytest.importorskip("math_verify")  # accuracy_reward's verifier (the `math` extra)
trl_accuracy_reward, think_format_reward = trl.accuracy_reward, trl.think_format_reward
import trl_factories  # noqa: E402 (after the skips: it imports trl)

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


def run(tmp_path, model_dir, mode, reward_funcs=None):
    """A 4-step run on the dataset, replaying from the second step, scored by TRL's `accuracy_reward` and
    `think_format_reward` (or `reward_funcs`); returns (accuracy_reward's calls, the steps' rollouts,
    question id -> dataset row)."""
    calls = []

    def accuracy_reward(completions, solution, **kwargs):  # TRL's, recording what it is given
        calls.append({"completions": completions, "solution": solution, **kwargs})
        return trl_accuracy_reward(completions, solution, **kwargs)

    path = tmp_path / f"train_{mode}.jsonl"
    write_dataset(path)
    seed_everything(0)
    funcs = reward_funcs or [accuracy_reward, think_format_reward]
    module = tiny_module(model_dir, reward_funcs=funcs, num_generations=K)
    data = PromptDataModule(train_path=str(path), batch_size=4, val_fraction=0.0)
    # Any stored row replays (the tiny policy rarely answers right): these tests are about what a replayed
    # row carries to the rewards, not which rows replay.
    anything = SelectiveReplay(
        "uniform", replay_probability=1.0, replayed_trajectories="any_stored_including_incorrect"
    )
    replay = ReplayCallback(mode=mode, replay=anything, min_buffer_size=1)
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


TRL_REWARDS = {
    "accuracy_reward": trl.accuracy_reward,
    "reasoning_accuracy_reward": trl.reasoning_accuracy_reward,
    "think_format_reward": trl.think_format_reward,
    "get_soft_overlong_punishment": trl_factories.overlong,
    "get_repetition_penalty_reward": trl_factories.repetition,
    "get_cosine_scaled_reward": trl_factories.cosine,
}


def test_the_tests_cover_every_reward_trl_ships():
    shipped = {name for name in trl.__all__ if callable(getattr(trl, name))}  # less the submodules
    assert set(TRL_REWARDS) == shipped


@pytest.mark.parametrize("mode", ["mix", "swap"])
@pytest.mark.parametrize("name", list(TRL_REWARDS))
def test_each_trl_reward_trains_unchanged_and_scores_each_row_as_trl_does(
    tmp_path, tiny_model_dir, name, mode
):
    fn = TRL_REWARDS[name]
    _, steps, rows = run(tmp_path, tiny_model_dir, mode, reward_funcs=[fn])
    assert len(steps) == 4 and len(steps[0]) == 4 * K  # swap: stored rows after the first step
    for step in steps:
        # Each row's reward is the function's on what TRL gives it: the conversational completion, the
        # row's solution, its token ids without padding; None is left out of the sum (a total of 0).
        ids = [row[mask].tolist() for row, mask in zip(step.completion_ids.cpu(), step.completion_mask.cpu())]
        completions = [[{"role": "assistant", "content": text}] for text in step.completions]
        solutions = [rows[q]["solution"] for q in step.question_ids.tolist()]
        expected = fn(completions=completions, solution=solutions, completion_ids=ids)
        expected = torch.tensor([0.0 if e is None else e for e in expected], dtype=torch.float32)
        assert torch.equal(step.rewards.cpu(), expected)


PROTOCOL_REWARDS = [  # TRL's six, and three of protocol_rewards.py: by ids, by trainer_state, async
    "trl.rewards.accuracy_reward", "trl.rewards.reasoning_accuracy_reward", "trl.rewards.think_format_reward",
    "trl_factories.overlong", "trl_factories.repetition", "trl_factories.cosine",
    "protocol_rewards.length_reward", "protocol_rewards.progress_reward", "protocol_rewards.judge_reward",
]  # fmt: skip


def test_nine_rewards_written_to_trls_protocol_train_under_exgrpo_fit(tmp_path, tiny_model_dir):
    path = tmp_path / "train.jsonl"
    write_dataset(path)
    config = Path(__file__).resolve().parents[2] / "configs" / "exgrpo.yaml"
    cli = ExGRPOCLI(
        ExGRPOModule, PromptDataModule, save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=[
            "fit", f"--config={config}", f"--model.model_name_or_path={tiny_model_dir}",
            "--model.num_generations=4", "--model.max_completion_length=4", "--model.max_prompt_length=16",
            "--model.validate_at_start=false", "--data.synthetic=null", f"--data.train_path={path}",
            "--data.val_fraction=0", "--data.batch_size=4", "--trainer.max_steps=3",
            "--trainer.accelerator=cpu", "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false",
            f"--trainer.default_root_dir={tmp_path}",
            f"--model.reward_funcs=[{', '.join(PROTOCOL_REWARDS)}]",
        ],
    )  # fmt: skip
    assert cli.model.hparams.reward_timeout_seconds is not None  # all nine ran under the limit
    logged = cli.trainer.callback_metrics
    names = [reward_name(fn) for fn in cli.model.collector.reward_funcs]
    assert len(names) == 9 and all(f"train/rewards/{name}/mean" in logged for name in names)
    assert logged["train/rewards/progress_reward/mean"] == pytest.approx(2 / 3)  # step 2 of 3
    assert logged["train/judge_calls"] == 1.0

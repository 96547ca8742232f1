"""examples/own_module.py: a user's GRPO module trains ExGRPO with ReplayCallback; each contract mistake
stops the run with a message that names the fix."""

import csv
import importlib.util
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.contract import ContractError
from exgrpo_pl.data import ArithmeticTask, PromptDataModule, collate_rows
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.rewards import FormatReward
from exgrpo_pl.step.losses import compute_importance_weights

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_module.py"
spec = importlib.util.spec_from_file_location("own_module_example", EXAMPLE)
own_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(own_module)


class Spied(own_module.GRPO):
    """The example's module on the tiny test model, with a reward that varies, recording what it trained on.

    A random model never solves arithmetic; a format reward varies across its samples, so groups have
    non-zero advantages and replayed rows have a loss term.
    """

    def __init__(self, model_dir, **kwargs):
        super().__init__(model=model_dir, max_new_tokens=4, learning_rate=1e-3, **kwargs)
        self.reward_fn = FormatReward(r"[0-9].*")
        self.sampled_rows = []  # rows the module's own sampler was asked for, per call
        self.replayed_terms = []  # (per-token loss of the replayed rows, what ExGRPO's term is), per step
        self.is_weights = []  # mean f(w) over the replayed rows' tokens, per step

    def rollout(self, prompts, **columns):
        self.sampled_rows.append(len(prompts))
        return super().rollout(prompts, **columns)

    def replay_loss(self, per_token, logps, rollouts):
        out = super().replay_loss(per_token, logps, rollouts)
        rows = rollouts.replayed
        if rows.any():
            weights = compute_importance_weights(
                logps[rows], rollouts.behaviour_logps[rows], rollouts.completion_mask[rows]
            )
            self.replayed_terms.append((out[rows], -weights * rollouts.advantages[rows].unsqueeze(1)))
            self.is_weights.append(weights[rollouts.completion_mask[rows]].mean())
        return out


class RecordRollouts(Callback):
    def __init__(self):
        self.rollouts = []
        self.experience = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts.append(outputs["rollouts"])
        self.experience.append(batch.get("experience"))


def replay(mode, **kwargs):
    return ReplayCallback(
        mode=mode,
        min_buffer_size=1,
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0),
        **kwargs,
    )


def fit(tmp_path, module, callbacks, max_steps=3, data=None, ckpt_path=None, **trainer_kwargs):
    """Fit on `data`: a datamodule (default: 64 arithmetic questions, 4 a batch) or a training DataLoader."""
    seed_everything(0)
    trainer = Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=callbacks,
        **{"enable_checkpointing": False, "logger": False, **trainer_kwargs},
    )
    data = data or PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    if isinstance(data, DataLoader):
        trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
    else:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_is_weight_is_written_on_the_steps_that_replayed_and_on_no_other(tmp_path, tiny_model_dir):
    """Lightning writes a metric logged on an earlier step again, with its last value, at every logging step
    of the epoch; `train/is_weight`, logged by `replay_loss`, must not repeat on a step without replay."""
    callback = ReplayCallback(
        mode="mix", min_buffer_size=1, replay=SelectiveReplay(strategy="uniform", replay_probability=0.5)
    )
    record = RecordRollouts()
    logger = CSVLogger(tmp_path, name="", version="run")
    fit(tmp_path, Spied(tiny_model_dir), [callback, record], max_steps=8, logger=logger, log_every_n_steps=1)
    replayed = {step for step, rollouts in enumerate(record.rollouts) if bool(rollouts.replayed.any())}
    assert replayed and len(replayed) < 7  # steps with and without replay after the first
    with open(tmp_path / "run" / "metrics.csv") as file:
        written = {int(row["step"]) for row in csv.DictReader(file) if row.get("train/is_weight")}
    assert written == replayed


class MicroBatched(Spied):
    """Spied, its replay term computed in two micro-batches of rows (`replay_loss(..., rows=)`)."""

    def replay_loss(self, per_token, logps, rollouts):
        halves = (slice(0, len(rollouts) // 2), slice(len(rollouts) // 2, len(rollouts)))
        self.call_weights = []
        parts = []
        for rows in halves:
            parts.append(own_module.GRPO.replay_loss(self, per_token[rows], logps[rows], rollouts, rows=rows))
            replayed = rollouts.replayed[rows]
            if replayed.any():
                weights = compute_importance_weights(
                    logps[rows][replayed], rollouts.behaviour_logps[rows][replayed],
                    rollouts.completion_mask[rows][replayed],
                )  # fmt: skip
                self.call_weights.append(weights[rollouts.completion_mask[rows][replayed]].mean())
        return torch.cat(parts)


def test_a_step_of_micro_batches_logs_the_mean_is_weight_of_those_that_replayed(tmp_path, tiny_model_dir):
    module = MicroBatched(tiny_model_dir)
    trainer = fit(tmp_path, module, [replay("swap")], max_steps=3)
    assert len(module.call_weights) == 2  # a swap step trains on stored rows only: both halves replayed
    expected = torch.stack(module.call_weights).mean()
    assert torch.allclose(trainer.callback_metrics["train/is_weight"], expected)


def test_the_replay_lines_are_at_most_ten():
    marked = [line for line in EXAMPLE.read_text().splitlines() if re.search(r"# replay(\s|$)", line)]
    assert 0 < len(marked) <= 10


@pytest.mark.parametrize("mode", ["mix", "swap"])
def test_replayed_rows_are_trained_on(tmp_path, tiny_model_dir, mode):
    module, record, callback = Spied(tiny_model_dir), RecordRollouts(), replay(mode)
    trainer = fit(tmp_path, module, [callback, record])
    assert callback.replayed_steps == 2  # the first step filled the buffer
    # replay_loss logs the replayed tokens' mean f(w), as ExGRPOModule does.
    assert torch.allclose(trainer.callback_metrics["train/is_weight"], module.is_weights[-1])
    k = module.num_generations
    for rollouts, experience in zip(record.rollouts[1:], record.experience[1:], strict=True):
        stored = experience.rollouts
        replayed = rollouts.select(rollouts.replayed)
        # The stored rows themselves, flagged, with the tokens and behaviour log-probs the buffer kept.
        assert sorted(replayed.question_ids.tolist()) == sorted(stored.question_ids.tolist())
        assert torch.equal(replayed.behaviour_logps.sum(), stored.behaviour_logps.sum())
        if mode == "mix":  # 2 of 4 questions replayed: a stored row first in each of the last two groups
            assert rollouts.group_size == k and rollouts.replayed.view(4, k).sum(1).tolist() == [0, 0, 1, 1]
            assert rollouts.replayed.view(4, k)[2:, 0].all()
        else:
            assert rollouts.replayed.all() and rollouts.group_size == 1
    # The module sampled K rollouts of 4 questions on step 1; then 2 x K + 2 x (K-1) in mix, nothing in swap.
    assert module.sampled_rows == ([16, 14, 14] if mode == "mix" else [16])
    # Replayed rows' loss terms are ExGRPO's -f(w) A, with gradient, not the clipped on-policy ones.
    assert len(module.replayed_terms) == 2
    for terms, expected in module.replayed_terms:
        assert terms.requires_grad and torch.allclose(terms, expected)
    assert any(bool(expected.abs().sum() > 0) for _, expected in module.replayed_terms)


@pytest.mark.slow
def test_resumes_from_a_checkpoint_with_its_buffer(tmp_path, tiny_model_dir):
    first = replay("mix")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path, Spied(tiny_model_dir), [first, checkpoint], max_steps=2, enable_checkpointing=True)
    resumed, record = replay("mix"), RecordRollouts()
    trainer = fit(
        tmp_path,
        Spied(tiny_model_dir),
        [resumed, record],
        max_steps=4,
        ckpt_path=tmp_path / "ckpt" / "last.ckpt",
    )
    assert trainer.global_step == 4 and len(record.rollouts) == 2  # steps 3 and 4 only
    assert resumed.replayed_steps == first.replayed_steps + 2  # counters and buffer came back; both replayed
    assert all(r.replayed.any() for r in record.rollouts)


def test_without_the_callback_it_trains_plain_grpo(tmp_path, tiny_model_dir):
    module, record = Spied(tiny_model_dir), RecordRollouts()
    fit(tmp_path, module, [record], max_steps=2)
    assert all(not r.replayed.any() and r.group_size == 4 for r in record.rollouts)
    assert module.replayed_terms == []


def test_the_step_log_says_how_many_steps_replayed_and_the_reward_before_and_after(tmp_path, tiny_model_dir):
    log, record = own_module.StepLog(), RecordRollouts()
    fit(tmp_path, Spied(tiny_model_dir), [replay("mix"), log, record], max_steps=4)
    fresh = [r.rewards[~r.replayed].mean().item() for r in record.rollouts]
    assert log.summary() == (  # 2 of 4 questions replayed on each step after the first
        "replay: 3 of 4 steps trained on stored trajectories, 6 in all\n"
        f"reward of fresh rollouts: {(fresh[0] + fresh[1]) / 2:.3f} over steps 1-2, "
        f"{(fresh[2] + fresh[3]) / 2:.3f} over steps 3-4"
    )


class LoggedReward(Callback):
    """(the "reward" the module logged, the mean reward of the step's fresh rows), per step."""

    def __init__(self):
        self.pairs = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts = outputs["rollouts"]
        fresh = rollouts.rewards[~rollouts.replayed].mean().item()
        self.pairs.append((trainer.callback_metrics["reward"].item(), fresh))


def test_the_logged_reward_is_the_fresh_rows_not_the_stored_ones(tmp_path, tiny_model_dir):
    log = LoggedReward()
    fit(tmp_path, Spied(tiny_model_dir), [replay("mix"), log], max_steps=3)
    assert [logged for logged, _ in log.pairs] == pytest.approx([fresh for _, fresh in log.pairs])


class SeldomRewarded(Spied):
    """A reward the tiny model seldom earns: groups come out all 0 (dead), and a few have a correct row."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.reward_fn = FormatReward(r"[12].*")


class RecordGaveWay(Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((outputs["rollouts"], outputs["gave_way"]))


def test_refill_fills_the_places_of_dead_groups_with_stored_questions(tmp_path, tiny_model_dir):
    """`--placement refill`: replay_groups gives each dead group's place to a stored question (its stored row
    first, then K-1 new rollouts of a second sampler call) and the step returns the groups that gave way."""
    module, record = SeldomRewarded(tiny_model_dir), RecordGaveWay()
    fit(tmp_path, module, [replay("mix", placement="refill"), record], max_steps=4)
    refilled = [(r, g) for r, g in record.steps if r.replayed.any()]
    assert refilled
    for rollouts, gave_way in refilled:
        k = rollouts.group_size
        assert rollouts.replayed.view(-1, k)[:, 0].sum() == rollouts.replayed.sum()
        assert len(gave_way) == int(rollouts.replayed.sum()) * k and not gave_way.rewards.any()
    # every step samples its 16 rows; a refill step samples K-1 more for each stored question it places
    assert module.sampled_rows[0] == 16 and any(n % 3 == 0 and n < 16 for n in module.sampled_rows[1:])


@pytest.mark.slow
def test_runs_as_a_script_on_the_embedded_policy(capsys):
    threads = torch.get_num_threads()
    trainer = own_module.main(["--max-steps", "2", "--batch-size", "4"])
    torch.set_num_threads(threads)
    assert trainer.global_step == 2
    out = capsys.readouterr().out  # 2 steps of 4 x 4 rollouts: the buffer never reaches min_buffer_size=64
    assert "replay: 0 of 2 steps trained on stored trajectories, 0 in all (replay starts once" in out
    assert re.search(r"reward of fresh rollouts: \d\.\d{3} over steps 1-1, \d\.\d{3} over steps 2-2", out)


# ------------------------------------------------------------------------ the mistakes, one by one
class ReturnsTheLoss(Spied):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)["loss"]


class ReturnsLossDict(Spied):
    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx)["loss"]}


class KeepsIntMasks(Spied):
    """Builds its RolloutBatch by hand and leaves the tokenizer's 0/1 attention mask in it."""

    def training_step(self, batch, batch_idx):
        rollouts = super().training_step(batch, batch_idx)["rollouts"]
        fields = {name: getattr(rollouts, name) for name in RolloutBatch.__dataclass_fields__}
        return RolloutBatch(**{**fields, "prompt_mask": rollouts.prompt_mask.long()})


class ForgetsReplayLoss(Spied):
    """Its training_step never passes the per-token loss through replay_loss."""

    def replay_loss(self, per_token, logps, rollouts):
        return per_token


class IgnoresExperience(Spied):
    def training_step(self, batch, batch_idx):
        return super().training_step({k: v for k, v in batch.items() if k != "experience"}, batch_idx)


class UnflagsReplayedRows(Spied):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        out["rollouts"].replayed = torch.zeros_like(out["rollouts"].replayed)
        return out


class SamplesKPerPrompt(Spied):
    """Its sampler kept an inline step's `generate(num_return_sequences=K)`: K completions a prompt."""

    def rollout(self, prompts, **columns):
        return tuple(
            t.repeat_interleave(self.num_generations, 0) for t in super().rollout(prompts, **columns)
        )


def renamed_key_loader(key="prompt", new_key="prompts"):
    """A datamodule-like loader whose batches say `new_key` where the contract says `key`."""
    rows = ArithmeticTask(num_questions=16, seed=1).rows()

    def collate(batch_rows):
        batch = collate_rows(batch_rows)
        batch[new_key] = batch.pop(key)
        return batch

    return DataLoader(rows, batch_size=4, collate_fn=collate)


@pytest.mark.parametrize(
    "module_class, mode, message",
    [
        (ReturnsTheLoss, "mix", r'returned only the loss.*return \{"loss": loss, "rollouts": rollouts\}'),
        (ReturnsLossDict, "mix", r'without \'rollouts\'.*return \{"loss": loss, "rollouts": rollouts\}'),
        (KeepsIntMasks, "mix", r"prompt_mask is torch.int64; prompt_mask must be bool \(e.g. .*\.bool\(\)\)"),
        (IgnoresExperience, "mix", r"ignored batch\['experience'\].*ReplayMixin.replay_groups"),
        (IgnoresExperience, "swap", r"ignored batch\['experience'\].*ReplayMixin.replay_groups"),
        (UnflagsReplayedRows, "mix", r"have replayed=False: keep their replayed=True flag"),
        (UnflagsReplayedRows, "swap", r"have replayed=False: keep their replayed=True flag"),
        *[
            (
                ForgetsReplayLoss,
                mode,
                r"ForgetsReplayLoss.training_step trained on \d+ replayed rows from replay_groups without "
                r"calling replay_loss.*per_token = self.replay_loss\(per_token, logps, rollouts\)",
            )
            for mode in ("mix", "swap")
        ],
        (
            SamplesKPerPrompt,
            "mix",
            r"rollout_fn \(SamplesKPerPrompt.rollout\) was given 16 prompts.*64 rows of prompt_ids, 4 per "
            r"prompt: it must sample ONE completion.*drop num_return_sequences \(or the repeat\)",
        ),
    ],
)
def test_each_mistake_stops_the_run_naming_the_fix(tmp_path, tiny_model_dir, module_class, mode, message):
    with pytest.raises((ContractError, TypeError, ValueError), match=message):
        fit(tmp_path, module_class(tiny_model_dir), [replay(mode)])


def test_a_batch_keyed_prompts_names_the_key_and_the_batch_contract(tmp_path, tiny_model_dir):
    with pytest.raises(ContractError, match=r"no 'prompt' key \(it has \[.*'prompts'.*\]\).*'question_id'"):
        fit(tmp_path, Spied(tiny_model_dir), [replay("mix")], data=renamed_key_loader())


def test_mix_mode_without_an_answer_key_stops_the_first_step_naming_it(tmp_path, tiny_model_dir):
    """Before the first step, not at the first replay: a datamodule with `answers` would otherwise train until
    replay starts and then score the replayed questions' rollouts without their answers."""
    module = Spied(tiny_model_dir)
    with pytest.raises(
        ContractError, match=r"no 'answer' key \(it has \['answers', .*rename the datamodule's"
    ):
        fit(tmp_path, module, [replay("mix")], data=renamed_key_loader("answer", "answers"))
    assert module.sampled_rows == []  # the module never sampled
    fit(tmp_path, Spied(tiny_model_dir), [replay("swap")], data=renamed_key_loader("answer", "answers"))


def test_a_module_without_the_contract_members_is_refused_naming_them(tmp_path):
    class Plain(LightningModule):  # a GRPO module without ReplayMixin (and without num_generations)
        def training_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return None

    with pytest.raises(TypeError, match=r"num_generations, score_entropy and entropy_forwards"):
        fit(tmp_path, Plain(), [replay("mix")], data=renamed_key_loader())

"""A GRPO module written elsewhere, TRL-style (tests/module/trl_style_module.py: its own plain DataLoader,
advantages from a method not named as the hook, reward functions scored after the forward), made
replay-ready from the docs: what stays exact, and each mistake named with its fix."""

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader
from trl_style_module import PlainGRPO, ReplayReadyGRPO, accuracy_reward, digits_reward, short_reward

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.contract import ContractError
from exgrpo_pl.data import collate_rows
from exgrpo_pl.experience import SelectiveReplay


def fit(tmp_path, module, callbacks=(), max_steps=3, ckpt_path=None, **trainer_kwargs):
    seed_everything(0)
    settings = dict(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=list(callbacks),
    )  # fmt: skip
    trainer = Trainer(**{**settings, **trainer_kwargs})
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def replay(mode="mix", probability=1.0, **kwargs):
    strategy = SelectiveReplay("uniform", replay_probability=probability)
    return ReplayCallback(mode=mode, min_buffer_size=1, replay=strategy, **kwargs)


class Record(Callback):
    """Each step's rollouts and what the module logged."""

    def __init__(self):
        self.rollouts, self.metrics, self.gave_way = [], [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts.append(outputs["rollouts"])
        self.gave_way.append(outputs.get("gave_way"))
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def same_parameters(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


# ---------------------------------------------------------------------------------------- 1. resume
class StatefulLoader(ReplayReadyGRPO):
    """The loader the contract asks for: resumable, shuffling with a generator of its own."""

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        return StatefulDataLoader(
            self.rows, batch_size=self.batch_size, shuffle=True, collate_fn=collate_rows, generator=generator
        )


def test_a_plain_dataloader_is_named_at_fit_start_with_the_fix(tmp_path, tiny_model_dir):
    with pytest.warns(UserWarning, match="a resumed run will not continue this one exactly") as caught:
        fit(tmp_path, ReplayReadyGRPO(tiny_model_dir), [replay()], max_steps=1, enable_checkpointing=True)
    (message,) = [str(w.message) for w in caught if "will not continue" in str(w.message)]
    assert "DataLoader without state_dict()/load_state_dict()" in message
    assert "no generator of its own" in message and "StatefulDataLoader" in message
    assert "generator=torch.Generator().manual_seed(seed)" in message


def test_a_stateful_loader_with_its_own_generator_resumes_bitwise(tmp_path, tiny_model_dir, recwarn):
    """2 steps + resume from the middle of the epoch + 2 steps equals 4 steps straight, and no loader
    warning: the conditions the contract's 'Resume' gives."""
    whole = StatefulLoader(tiny_model_dir)
    fit(tmp_path / "whole", whole, [replay(probability=0.5)], max_steps=4)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(tmp_path / "a", StatefulLoader(tiny_model_dir), [replay(probability=0.5), checkpoint], max_steps=2,
        enable_checkpointing=True)  # fmt: skip
    torch.manual_seed(123)  # whatever ran in between
    resumed = StatefulLoader(tiny_model_dir)
    ckpt = str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    fit(tmp_path / "b", resumed, [replay(probability=0.5)], max_steps=4, ckpt_path=ckpt)
    assert same_parameters(whole, resumed)
    assert not [w for w in recwarn if "will not continue" in str(w.message)]


# ------------------------------------------------------------------------------------ 2. advantages
class NotTold(ReplayReadyGRPO):
    """Adopts replay_groups without saying which advantages, as the docs' sketch did."""

    def groups(self, batch):
        return self.replay_groups(batch, self.rollout)


def test_advantages_named_otherwise_are_never_replaced_silently(tmp_path, tiny_model_dir):
    with pytest.raises(ContractError, match=r"NotTold has _compute_advantages: if that is its definition"):
        fit(tmp_path, NotTold(tiny_model_dir), max_steps=1)


def test_without_the_callback_it_trains_exactly_as_the_plain_module(tmp_path, tiny_model_dir):
    """Its own advantages (eps 1e-6, passed explicitly) and its rewards, scored in the sampler now."""
    plain, ready, record = PlainGRPO(tiny_model_dir), ReplayReadyGRPO(tiny_model_dir), Record()
    fit(tmp_path, plain, max_steps=5)
    fit(tmp_path, ready, [record], max_steps=5)
    assert any(bool(r.advantages.abs().sum() > 0) for r in record.rollouts)
    assert same_parameters(plain, ready)


# ------------------------------------------------------------------------------------ 3. refill
def leading_one_or_two(completions, **columns):
    """A reward the tiny model seldom earns: many groups come out all 0 (dead), a few have a correct row."""
    return [1.0 if c[:1] in "12" else 0.0 for c in completions]


class RareReward(ReplayReadyGRPO):
    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.reward_funcs = [leading_one_or_two]


def test_refill_fills_dead_groups_with_stored_questions_and_the_modules_advantages(tmp_path, tiny_model_dir):
    module, record, callback = RareReward(tiny_model_dir), Record(), replay(placement="refill")
    fit(tmp_path, module, [callback, record], max_steps=4)
    refilled = [(r, g) for r, g in zip(record.rollouts, record.gave_way) if r.replayed.any()]
    assert refilled and callback.replayed_steps >= 1
    for rollouts, gave_way in refilled:
        k = rollouts.group_size
        assert rollouts.replayed.view(-1, k)[:, 0].sum() == rollouts.replayed.sum()  # stored row first
        assert gave_way is not None and len(gave_way) == int(rollouts.replayed.sum()) * k
        grouped = gave_way.rewards.view(-1, k)
        assert bool((grouped == grouped[:, :1]).all())  # only dead groups gave way
        expected = module._compute_advantages(rollouts.rewards.view(-1, k)).reshape(-1)
        torch.testing.assert_close(rollouts.advantages, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------- 4. per-group metrics
class GroupMetrics(ReplayReadyGRPO):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.fresh_group_shapes.append(tuple(self.fresh_groups(out["rollouts"]).shape))
        return out


@pytest.mark.parametrize("mode, replayed_shape", [("swap", (0, 1)), ("mix", (2, 4))])
def test_fresh_groups_leave_stored_rows_out(tmp_path, tiny_model_dir, mode, replayed_shape):
    module = GroupMetrics(tiny_model_dir)
    module.fresh_group_shapes = []
    fit(tmp_path, module, [replay(mode)], max_steps=2)
    assert module.fresh_group_shapes == [(4, 4), replayed_shape]  # a fresh step, then a replay step


# ------------------------------------------------------------------------------------ 5. messages
class KPerPrompt(ReplayReadyGRPO):
    """Still samples K completions per prompt in its sampler."""

    def rollout(self, prompts, **columns):
        *sequences, texts = self.generate(prompts, self.num_generations)
        return (*sequences, self.score(texts, **columns))


def test_a_sampler_drawing_k_per_prompt_is_named_where_its_reward_fails(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=r"zip\(\) argument 2 is shorter") as caught:
        fit(tmp_path, KPerPrompt(tiny_model_dir), max_steps=1)
    (note,) = caught.value.__notes__
    assert "rollout_fn (KPerPrompt.rollout) was given 16 prompts" in note
    assert "num_return_sequences=4" in note and "sample ONE completion per entry of `prompts`" in note


class ScoresAfterForward(ReplayReadyGRPO):
    """Left its scoring after the forward: the sampler returns no rewards (zeros)."""

    def rollout(self, prompts, **columns):
        *sequences, _ = self.generate(prompts, 1)
        return (*sequences, torch.zeros(len(prompts), device=self.device))


def test_a_sampler_returning_zero_rewards_is_named_when_the_run_ends(tmp_path, tiny_model_dir):
    with pytest.warns(UserWarning, match=r"had a reward of exactly 0.*score in the sampler"):
        fit(tmp_path, ScoresAfterForward(tiny_model_dir), [replay()], max_steps=2)


class MaskWithoutEOS(ReplayReadyGRPO):
    def generate(self, prompts, k):
        prompt_ids, prompt_mask, completion_ids, _, texts = super().generate(prompts, k)
        is_eos = completion_ids == self.tokenizer.eos_token_id
        return prompt_ids, prompt_mask, completion_ids, is_eos.cumsum(1) == 0, texts


def test_a_completion_mask_without_the_eos_is_stopped(tmp_path, tiny_model_dir):
    with pytest.raises(ContractError, match=r"completion_mask is False on the EOS token .* is_eos.cumsum"):
        fit(tmp_path, MaskWithoutEOS(tiny_model_dir), [replay()], max_steps=1)


# --------------------------------------------------------------------------------- 6. fit start
def test_the_default_min_buffer_size_out_of_reach_is_said_at_fit_start(tmp_path, tiny_model_dir):
    with pytest.warns(UserWarning, match=r"min_buffer_size=1000 .* at most 32 .*replay can never start"):
        fit(tmp_path, ReplayReadyGRPO(tiny_model_dir), [ReplayCallback()], max_steps=2)


# ----------------------------------------------------------------------- 7. per-function rewards
def test_per_function_rewards_from_the_sampler_are_summed_and_logged(tmp_path, tiny_model_dir):
    """A row's reward is the functions' sum, and each function's mean over the fresh rows is logged."""
    module, record = ReplayReadyGRPO(tiny_model_dir), Record()
    fit(tmp_path, module, [replay(), record], max_steps=2)
    for rollouts, metrics in zip(record.rollouts, record.metrics):
        fresh = rollouts.select(~rollouts.replayed)
        texts = module.tokenizer.batch_decode(fresh.completion_ids, skip_special_tokens=True)
        parts = {fn.__name__: torch.tensor(fn(texts, answer=fresh.answers))
                 for fn in (digits_reward, short_reward, accuracy_reward)}  # fmt: skip
        total = parts["digits_reward"] + parts["short_reward"] + parts["accuracy_reward"]
        assert torch.equal(fresh.rewards, total)
        for name, values in parts.items():
            assert metrics[f"rewards/{name}"] == pytest.approx(float(values.mean()))

"""One run seed derives every random stream: `derive_seed` / `split_seed`, and Trainer runs in which two seeds
differ in data order and replay draws while the same seed reproduces the run exactly."""

import pytest
import torch
from conftest import tiny_module
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.seeding import derive_seed, run_seed, split_seed


def test_derive_seed_follows_the_run_seed_and_the_purpose(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert run_seed() == 0
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    assert run_seed() == 7
    seeds = {derive_seed("data"), derive_seed("replay"), *(derive_seed("validation", k) for k in (0, 1))}
    assert len(seeds) == 4 and all(0 <= s < 2**31 for s in seeds)
    before = derive_seed("data")
    monkeypatch.setenv("PL_GLOBAL_SEED", "8")
    assert derive_seed("data") != before


@given(st.integers(0, 2**31 - 2), st.integers(1, 1000))
def test_neighbouring_seeds_share_no_sub_stream(seed, key):
    assert split_seed(seed, key) != split_seed(seed + 1, key - 1)
    assert split_seed(seed, key) == split_seed(seed, key) < 2**31


def test_selective_replay_follows_the_run_seed_until_it_draws(monkeypatch):
    def decisions(replay):
        return [replay.should_replay() for _ in range(64)]

    monkeypatch.setenv("PL_GLOBAL_SEED", "1")
    under_1 = SelectiveReplay(replay_probability=0.5)
    explicit = SelectiveReplay(replay_probability=0.5, seed=5)
    monkeypatch.setenv("PL_GLOBAL_SEED", "2")
    under_2 = SelectiveReplay(replay_probability=0.5)
    late = SelectiveReplay(replay_probability=0.5)
    monkeypatch.setenv("PL_GLOBAL_SEED", "1")
    late.follow_run_seed()  # built before seed_everything(1): reseeded
    explicit.follow_run_seed()  # an explicit seed stays
    assert decisions(under_1) == decisions(late) != decisions(under_2)
    assert decisions(explicit) == decisions(SelectiveReplay(replay_probability=0.5, seed=5))
    state = late.state_dict()
    late.follow_run_seed()  # it has drawn: the stream goes on
    assert torch.equal(late.state_dict()["decision_generator"], state["decision_generator"])


class RecordedReplay(SelectiveReplay):
    """SelectiveReplay that records its coin flips."""

    def __init__(self):
        super().__init__("uniform", replay_probability=0.9)
        self.flips = []

    def should_replay(self):
        self.flips.append(super().should_replay())
        return self.flips[-1]


class Record(Callback):
    """Each step's question ids, whether it replayed, and its completions."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts = outputs["rollouts"]
        replayed = bool(rollouts.replayed.any())
        self.steps.append((batch["question_id"].tolist(), replayed, rollouts.completions))


def fit(tmp_path, model_dir, seed):
    """A seeded ExGRPO run with nothing seeded explicitly (data order and replay follow the run seed)."""
    seed_everything(seed)
    record, replay = Record(), ReplayCallback(mode="swap", min_buffer_size=1, replay=RecordedReplay())
    trainer = Trainer(
        max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=[replay, record],
    )  # fmt: skip
    module = tiny_module(model_dir, num_generations=2, max_completion_length=3)
    data = PromptDataModule(synthetic=ArithmeticTask(16, seed=1), batch_size=4, val_fraction=0.0)
    trainer.fit(module, data)
    return record.steps, replay.replay.flips, module.policy.state_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    return {
        name: fit(tmp_path_factory.mktemp(name), tiny_model_dir, seed)
        for name, seed in [("seed 1", 1), ("seed 1 again", 1), ("seed 2", 2)]
    }


def test_the_same_seed_reproduces_a_run_exactly(runs):
    (steps, flips, weights), (steps_again, flips_again, weights_again) = runs["seed 1"], runs["seed 1 again"]
    assert steps == steps_again and flips == flips_again and any(replayed for _, replayed, _ in steps)
    assert all(torch.equal(weights[k], weights_again[k]) for k in weights)


def test_two_seeds_differ_in_data_order_and_replay_draws(runs):
    (one, flips_one, _), (two, flips_two, _) = runs["seed 1"], runs["seed 2"]
    assert one[0][0] != two[0][0]  # the first batch's questions
    assert flips_one != flips_two

"""ReplayCallback(displaced_questions="defer") under 2-process DDP on CPU (gloo), with bounded demand: every
rank displaces as many questions at each step (the fewest any rank's demand allows), so the ranks' streams
reach each pass boundary together and the ranks together train on every question once a pass; a resumed
run is the uninterrupted one on every rank."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from test_replay_defer import K, RecordSteps, check_deferred
from test_resume import assert_same

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer

# These tests are about rank bookkeeping, not which rows are drawn: every stored row may be replayed.
ANY_STORED = {"replayed_trajectories": "any_stored_including_incorrect"}

pytestmark = pytest.mark.multiprocess

ROWS, BATCH = 12, 2  # 2 questions a step on each of 2 ranks: 3 steps an epoch


class DeferringReplay(ReplayCallback):
    """Records each step's bounded demand on this rank, before the ranks agree; rank 1's is one question
    less, as if its medium range held fewer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.demands = []

    def _demand(self, batch, k):
        demand = super()._demand(batch, k)
        self.demands.append(max(demand - dist.get_rank(), 0))
        return self.demands[-1]


class SaveRank(Callback):
    """Writes this rank's steps, demands and pass numbers, and saves its final state."""

    def __init__(self, root, name):
        self.root, self.name, self.passes = root, name, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.passes.append(trainer.datamodule._sampler.order_epoch)

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        record = next(c for c in trainer.callbacks if isinstance(c, RecordSteps))
        rank = trainer.global_rank
        summary = {"steps": record.steps, "demands": replay.demands, "passes": self.passes}
        (self.root / f"{self.name}-rank{rank}.json").write_text(json.dumps(summary))
        state = {
            "weights": pl_module.policy.state_dict(),
            "buffer": replay.buffer.state_dict(),
            "data": trainer.train_dataloader.state_dict(),
            "deferred_total": replay.deferred_total,
            "sampling_generator": torch.get_rng_state(),
        }
        torch.save(state, self.root / f"{self.name}-rank{rank}.pt")


def fit(root, model_dir, name, max_steps, ckpt_path=None):
    seed_everything(0)
    replay = DeferringReplay(
        mode="mix",
        mix_fraction=1.0,
        bounded_demand=True,
        min_buffer_size=1,
        displaced_questions="defer",
        replay=SelectiveReplay(
            "uniform", replay_probability=1.0, medium_difficulty_range=(0.0, 0.6), **ANY_STORED
        ),
        buffer=TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4)),
    )
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy="ddp_fork", max_steps=max_steps, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
        plugins=[AtomicCheckpointIO()],
        callbacks=[replay, RecordSteps(), SafeModelCheckpoint(dirpath=root / "checkpoints", save_last="link"),
                   SaveRank(root, name)],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(ROWS, seed=1), batch_size=BATCH, val_fraction=0.0)
    module = tiny_module(model_dir, num_generations=K, max_completion_length=3)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    summaries = [json.loads((root / f"{name}-rank{r}.json").read_text()) for r in range(2)]
    states = [torch.load(root / f"{name}-rank{r}.pt", weights_only=True) for r in range(2)]
    return summaries, states


def test_every_rank_defers_alike_and_a_resumed_run_is_the_uninterrupted_one(tmp_path, tiny_model_dir):
    straight, straight_states = fit(tmp_path / "straight", tiny_model_dir, "straight", 8)
    ranks = [[BATCH - len(fresh) for _, fresh, _, _ in rank["steps"]] for rank in straight]
    # As many displaced on both ranks at every step: the fewer of the two demands.
    own = [rank["demands"] for rank in straight]  # every step tossed for replay (probability 1)
    assert ranks[0] == ranks[1] == [min(a, b) for a, b in zip(*own)] and 1 in ranks[0]
    assert any(a > b > 0 for a, b in zip(*own))  # rank 0 replayed fewer than it would have
    assert straight[0]["passes"] == straight[1]["passes"] and straight[0]["passes"][-1] >= 1
    for rank in straight:
        check_deferred(rank["steps"], BATCH)
    # Together, the ranks trained on every question of the first pass once.
    first_pass = [sum((fresh for _, fresh, _, _ in rank["steps"]), [])[: ROWS // 2] for rank in straight]
    assert sorted(first_pass[0] + first_pass[1]) == list(range(ROWS))

    first, _ = fit(tmp_path / "split", tiny_model_dir, "first", 6)
    assert [rank["steps"][-1][3] for rank in first] == [1, 1]  # stopped with a question waiting on each
    resumed, resumed_states = fit(tmp_path / "split", tiny_model_dir, "resumed", 8, ckpt_path="last")
    for rank in range(2):
        assert resumed[rank]["steps"] == straight[rank]["steps"][6:]
        assert_same(straight_states[rank], resumed_states[rank], f"rank {rank}")

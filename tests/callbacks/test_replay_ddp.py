"""ReplayCallback under 2-process DDP on CPU (gloo): same decisions on every rank, per-rank checkpoints, the
same number of rescoring forwards on every rank when the strategy needs it, and a resumed run that is the
uninterrupted one on every rank."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from test_resume import assert_same

from exgrpo_pl.callbacks import ReplayCallback, replay_state
from exgrpo_pl.callbacks import replay as replay_callback
from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer

# These tests are about rank bookkeeping, not which rows are drawn: every stored row may be replayed.
ANY_STORED = {"replayed_trajectories": "any_stored_including_incorrect"}

pytestmark = pytest.mark.multiprocess


def fit_two_ranks(module, callbacks, max_steps, rows=64, ckpt_path=None, **trainer_kwargs) -> None:
    """`module` trained by two forked CPU processes (gloo) on `rows` arithmetic questions, 2 prompts per
    step on each rank."""
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_fork",
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    data = PromptDataModule(synthetic=ArithmeticTask(rows, seed=1), batch_size=2, val_fraction=0.0)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)


class RecordDecisions(Callback):
    """Writes, per rank, whether each step replayed and how many rows its buffer holds."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append(bool(outputs["rollouts"].replayed.any()))

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        record = {"steps": self.steps, "buffer": len(replay.buffer)}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def test_every_rank_takes_the_same_replay_decisions_and_checkpoints_keep_each_buffer(
    tmp_path, tiny_model_dir
):
    seed_everything(0)
    replay = ReplayCallback(
        mode="swap",
        min_buffer_size=1,
        start_pass_rate=0.0,
        replay=SelectiveReplay(strategy="uniform", replay_probability=0.5),
    )
    module = tiny_module(tiny_model_dir, num_generations=2, max_completion_length=3)
    fit_two_ranks(module, [replay, RecordDecisions(tmp_path)], max_steps=6, default_root_dir=tmp_path)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"]
    assert any(ranks[0]["steps"]) and not all(ranks[0]["steps"])  # the coin really varied

    (checkpoint,) = tmp_path.rglob("*.ckpt")
    state = next(
        v for k, v in torch.load(checkpoint, weights_only=True)["callbacks"].items() if "Replay" in k
    )
    assert len(state["ranks"]) == 2  # rank 0 wrote both ranks' buffers
    for rank, record in enumerate(ranks):
        restored = ReplayCallback()
        restored.load_state_dict({"ranks": [state["ranks"][rank]]})
        assert len(restored.buffer) == record["buffer"] > 0


class UnevenReplay(SelectiveReplay):
    """The paper's selection, except that rank 1 samples no question every other step, so its pool is
    empty and it never calls `entropy_fn`; records how many candidates each step rescored."""

    def __init__(self):
        super().__init__(strategy="gaussian_lowest_entropy", replay_probability=1.0, **ANY_STORED)
        self.candidates = []

    def sample(self, buffer, size, entropy_fn=None):
        nothing = dist.get_rank() == 1 and len(self.candidates) % 2 == 0
        self.candidates.append(0)

        def counted(rollouts):
            self.candidates[-1] = len(rollouts)
            return entropy_fn(rollouts)

        return super().sample(buffer, 0 if nothing else size, entropy_fn=counted)


class CountRescoringForwards(ReplayCallback):
    """Counts the policy's forward calls inside `on_train_batch_start` (where rescoring runs)."""

    def __init__(self, out_dir, **kwargs):
        super().__init__(**kwargs)
        self.out_dir = out_dir
        self.total = 0
        self.forwards = []

    def on_fit_start(self, trainer, pl_module):
        pl_module.policy.register_forward_hook(self._count)

    def _count(self, module, args, output):
        self.total += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        before = self.total
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.forwards.append(self.total - before)

    def on_train_end(self, trainer, pl_module):
        record = {"forwards": self.forwards, "candidates": self.replay.candidates}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("synced", [True, False], ids=["zero3-sync", "ddp-default"])
def test_rescoring_runs_the_same_number_of_forwards_on_every_rank_when_synced(
    tmp_path, tiny_model_dir, monkeypatch, synced
):
    # The sync condition is ZeRO-3/FSDP; forced on here (ddp_fork: the children inherit the patch), where
    # unequal forward counts would merely differ instead of hanging.
    monkeypatch.setattr(replay_callback, "needs_synced_generation", lambda trainer: synced)
    seed_everything(0)
    micro_batch_size = 2
    callback = CountRescoringForwards(
        tmp_path, mode="swap", min_buffer_size=1, start_pass_rate=0.0, replay=UnevenReplay()
    )
    module = tiny_module(
        tiny_model_dir, num_generations=2, max_completion_length=3, micro_batch_size=micro_batch_size
    )
    fit_two_ranks(module, [callback], max_steps=5, enable_checkpointing=False)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    needed = [[-(-n // micro_batch_size) for n in rank["candidates"]] for rank in ranks]
    # Some replay step had rank 1 with nothing to rescore while rank 0 had candidates.
    assert any(a > 0 and b == 0 for a, b in zip(*needed))
    if synced:
        assert ranks[0]["forwards"] == ranks[1]["forwards"]
        assert ranks[0]["forwards"][1:] == [max(a, b) for a, b in zip(*needed)]
    else:  # DDP: each rank runs only its own micro-batches, no collective, no padding
        for rank, own in zip(ranks, needed):
            assert rank["forwards"][1:] == own


# Resume


class SaveRankState(Callback):
    """Records each step's rewards and replay decision, and saves this rank's final state to
    `<out_dir>/<name>-rank<r>.pt`."""

    def __init__(self, out_dir, name):
        self.path, self.steps = str(out_dir / f"{name}-rank{{rank}}.pt"), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollouts = outputs["rollouts"]
        self.steps.append((trainer.global_step, rollouts.rewards.clone(), bool(rollouts.replayed.any())))

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        state = {
            "steps": self.steps,
            "weights": pl_module.policy.state_dict(),
            "optimizer": trainer.optimizers[0].state_dict()["state"],
            "buffer": replay.buffer.state_dict(),
            "replay_generators": replay.replay.state_dict(),
            "sampling_generator": torch.get_rng_state(),
            "data": trainer.train_dataloader.state_dict(),
            "retired": sorted(replay.buffer.bucketer.retired),
            "excluded": sorted(trainer.datamodule.excluded_question_ids),
        }
        torch.save(state, self.path.format(rank=trainer.global_rank))


def fit_resumable(root, model_dir, name, max_steps, ckpt_path=None):
    seed_everything(0)
    replay = ReplayCallback(
        mode="swap",
        min_buffer_size=1,
        replay=SelectiveReplay(strategy="uniform", replay_probability=0.5),
        buffer=TrajectoryBuffer(bucketer=DifficultyBucketer(window_size=4, retire_from="buffer_and_stream")),
    )
    module = tiny_module(model_dir, num_generations=2, max_completion_length=3)
    checkpoint = SafeModelCheckpoint(dirpath=root / "checkpoints", save_last="link")
    fit_two_ranks(
        module, [replay, checkpoint, SaveRankState(root, name)], max_steps, rows=12, ckpt_path=ckpt_path,
        default_root_dir=root, plugins=[AtomicCheckpointIO()],
    )  # fmt: skip
    return [torch.load(root / f"{name}-rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("stop", [3, 4], ids=["at the end of epoch 0", "mid epoch 1"])
def test_a_resumed_two_rank_run_is_the_uninterrupted_run_on_every_rank(tmp_path, tiny_model_dir, stop):
    """12 questions, 2 a step on each of 2 ranks: 3 steps an epoch."""
    straight = fit_resumable(tmp_path / "straight", tiny_model_dir, "straight", 6)
    first = fit_resumable(tmp_path / "split", tiny_model_dir, "first", stop)
    resumed = fit_resumable(tmp_path / "split", tiny_model_dir, "resumed", 6, ckpt_path="last")
    # Questions were retired before the stop (epoch 1 leaves them out), and steps replayed.
    assert first[0]["retired"] + first[1]["retired"] and any(replayed for *_, replayed in first[0]["steps"])
    assert [step for step, *_ in resumed[0]["steps"]] == list(range(stop + 1, 7))
    for rank in range(2):
        straight[rank]["steps"] = straight[rank]["steps"][stop:]
        assert_same(straight[rank], resumed[rank], f"rank {rank}")
    assert straight[0]["excluded"] and not straight[0]["buffer"]["question_id"].equal(
        straight[1]["buffer"]["question_id"]
    )


class RecordStateDict(Callback):
    """Writes, per rank, what `ReplayCallback.state_dict()` returns there and the gather group's backend."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        state = replay.state_dict()
        group = replay_state.object_group()
        record = {
            "ranks": [len(s["buffer"]["seq"]) for s in state["ranks"]],
            "rank": state.get("rank"),
            "own": len(replay.buffer),
            "backend": dist.get_backend(group),
            "same_group": group is replay_state.object_group() and group is not dist.group.WORLD,
        }
        (self.out_dir / f"state{trainer.global_rank}.json").write_text(json.dumps(record))


def test_rank_0_alone_gathers_the_replay_states_over_a_gloo_group(tmp_path, tiny_model_dir):
    seed_everything(0)
    replay = ReplayCallback(mode="swap", min_buffer_size=1, start_pass_rate=0.0)
    module = tiny_module(tiny_model_dir, num_generations=2, max_completion_length=3)
    fit_two_ranks(module, [replay, RecordStateDict(tmp_path)], max_steps=3, enable_checkpointing=False)

    records = [json.loads((tmp_path / f"state{r}.json").read_text()) for r in range(2)]
    assert all(r["backend"] == "gloo" and r["same_group"] for r in records)  # made once, not the default
    assert records[0]["ranks"] == [records[0]["own"], records[1]["own"]] and records[0]["rank"] is None
    assert records[1]["ranks"] == [records[1]["own"]] and records[1]["rank"] == 1  # nothing gathered there

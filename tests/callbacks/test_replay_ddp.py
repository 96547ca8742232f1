"""ReplayCallback under 2-process DDP on CPU (gloo): same decisions on every rank, per-rank checkpoints, and
the same number of rescoring forwards on every rank when the strategy needs it."""

import json

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_module
from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.callbacks import replay as replay_callback
from lightning.pytorch import Callback, Trainer, seed_everything

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.replay import SelectiveReplay

pytestmark = pytest.mark.multiprocess


def fit_two_ranks(module, callbacks, max_steps, **trainer_kwargs) -> None:
    """`module` trained by two forked CPU processes (gloo) on the arithmetic task, 2 prompts per step."""
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
    trainer.fit(module, datamodule=PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=2))


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
        super().__init__(strategy="gaussian_lowest_entropy", replay_probability=1.0)
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

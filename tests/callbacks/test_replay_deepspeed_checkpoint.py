"""The replay buffer travels through real DeepSpeed checkpoint directories and comes back on resume.

Lightning's `DeepSpeedStrategy.save_checkpoint` hands DeepSpeed the checkpoint dict minus `state_dict` and
`optimizer_states` as `client_state`; DeepSpeed pickles it into `checkpoint/mp_rank_00_model_states.pt`
(dp rank 0 only) or, under ZeRO-3, into every rank's `checkpoint/zero_pp_rank_<r>_mp_rank_00_model_states.pt`,
and `load_checkpoint` returns it, from which Lightning restores the callbacks. So `ReplayCallback` gathers
every rank's replay state into that one file under ZeRO 0-2, and under ZeRO-3 leaves each rank's own in its
file. These tests run DeepSpeed's real engine and Lightning's real strategy on the CPU (gloo). The one
thing faked: `DeepSpeedStrategy` refuses a non-CUDA accelerator in `setup_environment`, which
`CPUDeepSpeedStrategy` skips; CPU devices get an index, which DeepSpeed needs as its device rank.
"""

import multiprocessing
import os
import socket
from types import SimpleNamespace

import pytest
import torch
from conftest import CPUDeepSpeedStrategy, tiny_module
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from test_buffer import assert_same, filled_buffer

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.checkpoints.saving import (
    COMPLETE_MARKER,
    SafeModelCheckpoint,
    incomplete_reason,
    mark_complete,
    newest_complete_checkpoint,
)
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer

deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e '.[deepspeed]')")
from deepspeed.accelerator import get_accelerator  # noqa: E402

pytestmark = pytest.mark.skipif(
    get_accelerator().device_name() != "cpu",
    reason="CPU stand-in for DeepSpeed; with an accelerator, scripts/gpu_smoke.sh checks the real path",
)


def own_state(callback: ReplayCallback) -> dict:
    """What one rank has to get back: its buffer, its generators and its counters."""
    return {
        "buffer": callback.buffer.state_dict(),
        "replay": callback.replay.state_dict(),
        "pass_rate_reached": callback.pass_rate_reached,
        "fallback_steps": callback.fallback_steps,
        "replayed_steps": callback.replayed_steps,
    }


def in_a_fresh_process(target, *args) -> None:
    """Runs `target` in a forked child, in a one-process gloo group as DeepSpeed wants it.

    A process of its own each time: DeepSpeed caches its process groups for the life of the process, and the
    test process must not be left inside a process group.
    """

    def child():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
        deepspeed.init_distributed(dist_backend="gloo")
        target(*args)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(timeout=300)
    assert process.exitcode == 0, "the child failed; its traceback is in the captured stderr"


class Linear(LightningModule):
    """Something for DeepSpeed to wrap; nothing here calls the replay contract's methods."""

    num_generations = 2

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def score_entropy(self, rollouts, num_forwards=None):
        raise NotImplementedError

    def entropy_forwards(self, rollouts):
        raise NotImplementedError


def attached_trainer(stage: int, callback: ReplayCallback) -> Trainer:
    """A Trainer whose DeepSpeedStrategy holds a real engine, as it does once `fit` has set it up."""
    strategy = CPUDeepSpeedStrategy(stage)
    trainer = Trainer(accelerator="cpu", strategy=strategy, callbacks=[callback], logger=False)
    module = Linear()
    module.trainer = trainer
    strategy.connect(module)
    trainer.state.fn = TrainerFn.FITTING
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    strategy.model, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    callback.setup(trainer, module, "fit")  # as fit does, before any checkpoint is saved or restored
    return trainer


def replay_callback(buffer: TrajectoryBuffer) -> ReplayCallback:
    return ReplayCallback(buffer=buffer, replay=SelectiveReplay(strategy="uniform"), min_buffer_size=1)


def save(stage, callback, path):
    # Trainer.save_checkpoint: dump_checkpoint (callbacks' state_dict) + DeepSpeedStrategy.save_checkpoint.
    attached_trainer(stage, callback).save_checkpoint(path)


def restore(stage, path, out):
    callback = replay_callback(TrajectoryBuffer(max_size=64, bucketer=DifficultyBucketer(window_size=8)))
    trainer = attached_trainer(stage, callback)
    # What Trainer.fit(ckpt_path=...) runs after setup for DeepSpeed (restore_checkpoint_after_setup=True):
    # DeepSpeedStrategy.load_checkpoint -> engine.load_checkpoint -> client_state -> load_state_dict.
    trainer._checkpoint_connector._restore_modules_and_callbacks(path)
    torch.save(own_state(callback), out)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_checkpoint_directory_holds_and_restores_the_buffer(stage, tmp_path):
    saved = replay_callback(filled_buffer())  # evictions, removals and a bucketer history
    saved.pass_rate_reached, saved.fallback_steps, saved.replayed_steps = True, 2, 5
    for _ in range(3):
        saved.replay.should_replay()  # the decision generator moves on from its seed
    assert len(saved.buffer) > 0

    path = tmp_path / "last.ckpt"
    in_a_fresh_process(save, stage, saved, path)
    model_states = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    assert (path / "checkpoint" / model_states).is_file()
    assert (path / "latest").read_text() == "checkpoint"
    mark_complete(str(path))  # as SafeModelCheckpoint does: then every file DeepSpeed loads is found there
    assert incomplete_reason(str(path)) is None
    client = torch.load(path / "checkpoint" / model_states, weights_only=False)
    (state,) = [v for k, v in client["callbacks"].items() if k.startswith("ReplayCallback")]
    assert len(state["ranks"]) == 1
    # ZeRO-3: each rank's file holds its own state, marked with its rank; ZeRO-2: the gathered states.
    assert (state.get("rank"), state.get("world_size")) == ((0, 1) if stage == 3 else (None, None))

    in_a_fresh_process(restore, stage, path, tmp_path / "restored.pt")
    restored = torch.load(tmp_path / "restored.pt", weights_only=True)
    assert_same(restored, own_state(saved))
    again = replay_callback(TrajectoryBuffer(max_size=64, bucketer=DifficultyBucketer(window_size=8)))
    again.load_state_dict({"ranks": [restored]})
    sample = lambda cb: cb.replay.sample(cb.buffer, 8).question_ids.tolist()  # noqa: E731
    assert sample(again) == sample(saved)


class RecordOwnState(Callback):
    """Saves each rank's own replay state: at the end of the first run, at the start of the resumed one."""

    def __init__(self, out_dir, when):
        self.out_dir, self.when = out_dir, when

    def _record(self, trainer):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        torch.save(own_state(replay), self.out_dir / f"{self.when}_rank{trainer.global_rank}.pt")

    def on_train_end(self, trainer, pl_module):
        if self.when == "saved":
            self._record(trainer)

    def on_train_start(self, trainer, pl_module):
        if self.when == "resumed":
            self._record(trainer)


def fit_two_ranks(tmp_path, tiny_model_dir, stage, when, max_steps, ckpt_path=None, checkpoint=None):
    seed_everything(0)
    replay = ReplayCallback(
        mode="swap",
        min_buffer_size=1,
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0),
    )
    trainer = Trainer(
        accelerator="cpu",
        strategy=CPUDeepSpeedStrategy(stage, devices=2, start_method="fork"),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[
            replay,
            RecordOwnState(tmp_path, when),
            checkpoint or ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0),
        ],
    )
    module = tiny_module(tiny_model_dir, num_generations=2, max_completion_length=3)
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=2)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [2, 3])
def test_each_rank_resumes_its_own_buffer_from_a_deepspeed_checkpoint(stage, tmp_path, tiny_model_dir):
    fit_two_ranks(tmp_path, tiny_model_dir, stage, "saved", max_steps=3)
    last = tmp_path / "ckpt" / "last.ckpt"
    files = sorted(p.name for p in (last / "checkpoint").glob("*model_states.pt"))
    if stage == 3:  # every rank writes (and later reads) its own file, each with its own replay state
        assert files == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(2)]
    else:  # dp rank 0 writes the one file every rank reads, with both ranks' replay states
        assert files == ["mp_rank_00_model_states.pt"]
    for rank, name in enumerate(files):  # as DeepSpeed's TorchCheckpointEngine.load reads it
        client = torch.load(last / "checkpoint" / name, weights_only=False)
        (state,) = [v for k, v in client["callbacks"].items() if k.startswith("ReplayCallback")]
        assert client["global_step"] == 3
        if stage == 3:
            assert len(state["ranks"]) == 1 and (state["rank"], state["world_size"]) == (rank, 2)
        else:
            assert len(state["ranks"]) == 2 and "rank" not in state

    fit_two_ranks(tmp_path, tiny_model_dir, stage, "resumed", max_steps=4, ckpt_path=last)
    saved = [torch.load(tmp_path / f"saved_rank{r}.pt", weights_only=True) for r in range(2)]
    resumed = [torch.load(tmp_path / f"resumed_rank{r}.pt", weights_only=True) for r in range(2)]
    for rank in range(2):
        assert len(saved[rank]["buffer"]["seq"]) > 0 and saved[rank]["replayed_steps"] == 2
        assert_same(resumed[rank], saved[rank])
    # The ranks saw different data: a rank handed the other's buffer would fail the comparison above.
    assert saved[0]["buffer"]["question_id"].tolist() != saved[1]["buffer"]["question_id"].tolist()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_deepspeed_folder_is_marked_complete_after_every_rank_wrote_its_shards(tmp_path, tiny_model_dir):
    checkpoint = SafeModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last="link")
    fit_two_ranks(tmp_path, tiny_model_dir, 3, "saved", max_steps=2, checkpoint=checkpoint)
    (folder,) = [p for p in (tmp_path / "ckpt").iterdir() if not p.is_symlink()]
    marker = folder / COMPLETE_MARKER
    shards = list((folder / "checkpoint").glob("*.pt"))  # ZeRO-3: model and optimizer states of both ranks
    assert len(shards) == 4 and all(marker.stat().st_mtime_ns >= s.stat().st_mtime_ns for s in shards)
    assert newest_complete_checkpoint([str(tmp_path / "ckpt")]) == str(folder)
    marker.unlink()  # what a kill before the marker leaves: DeepSpeed's `latest` alone does not count
    assert (folder / "latest").is_file()
    with pytest.warns(UserWarning, match="no complete, intact checkpoint"):
        assert newest_complete_checkpoint([str(tmp_path / "ckpt")]) is None


def test_a_save_into_an_existing_folder_unmarks_it_until_every_rank_has_written(tmp_path):
    """save_last: true saves into the same folder again: a kill during that save must not leave the old marker
    over half-written shards. A stand-in trainer records what a rank would see while DeepSpeed writes."""
    folder = tmp_path / "last.ckpt"
    folder.mkdir()
    marked_while_writing = []

    def save_checkpoint(filepath, weights_only=False):
        marked_while_writing.append((folder / COMPLETE_MARKER).exists())
        (folder / "latest").write_text("checkpoint")

    trainer = SimpleNamespace(
        lightning_module=torch.nn.Linear(2, 2), is_global_zero=True, global_step=1, loggers=[],
        strategy=SimpleNamespace(reduce_boolean_decision=lambda decision, all: decision),
        save_checkpoint=save_checkpoint,
    )  # fmt: skip
    checkpoint = SafeModelCheckpoint(dirpath=tmp_path, save_last=True)
    for _ in range(2):
        checkpoint._save_checkpoint(trainer, str(folder))
        assert (folder / COMPLETE_MARKER).is_file()
    assert marked_while_writing == [False, False]

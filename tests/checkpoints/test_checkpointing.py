"""Kill-proof checkpoints: atomic writes next to the target, temp cleanup, the non-finite refusal, "last"
resolving to the newest complete checkpoint, a save when training ends, and SIGKILL trials during saves."""

import errno
import functools
import http.server
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from conftest import fill_the_disk_for, tiny_module
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from exgrpo_pl.checkpoints.saving import (
    TEMP_NAME,
    AtomicCheckpointIO,
    NonFiniteCheckpointError,
    NotALightningCheckpointError,
    OutOfSpaceError,
    SafeModelCheckpoint,
    UnsafeCheckpointError,
    check_finite,
    check_loadable,
    first_non_finite,
    held_parameters,
    incomplete_reason,
    mark_complete,
    raise_if_out_of_space,
    remove_stale_temp_files,
    save_atomically,
    write_files_atomically,
)
from exgrpo_pl.cli import main
from exgrpo_pl.data import ArithmeticTask, PromptDataModule

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def fit(root, model_dir, callbacks, ckpt_path=None, **trainer_kwargs):
    seed_everything(0)
    trainer = Trainer(
        **{"max_steps": 3, **trainer_kwargs},
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=root, plugins=[AtomicCheckpointIO()], callbacks=callbacks,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4)
    trainer.fit(tiny_module(model_dir), data, ckpt_path=ckpt_path)
    return trainer


def step_of(path):
    return torch.load(path, weights_only=True)["global_step"]


def dead_pid():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


# Writing


def test_the_temp_file_is_next_to_the_target_whatever_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    seen, save = [], torch.save

    def spying_save(obj, file):
        seen.append(os.listdir(tmp_path / "ckpts"))
        save(obj, file)

    monkeypatch.setattr(torch, "save", spying_save)
    save_atomically({"w": torch.ones(3)}, str(tmp_path / "ckpts" / "a.ckpt"))
    (name,) = seen[0]
    assert TEMP_NAME.match(name)["name"] == "a.ckpt" and name.startswith(".a.ckpt.tmp-")
    assert os.listdir(tmp_path / "ckpts") == ["a.ckpt"] and os.listdir(tmp_path / "elsewhere") == []
    assert torch.equal(torch.load(tmp_path / "ckpts" / "a.ckpt")["w"], torch.ones(3))


def test_a_failed_save_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    save_atomically({"w": torch.zeros(1000)}, str(path))
    before = path.read_bytes()

    def failing_save(obj, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomically({"w": torch.ones(1000)}, str(path))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["last.ckpt"]


def test_only_temp_files_of_finished_processes_are_cleaned_up(tmp_path):
    dead, alive = dead_pid(), os.getppid()
    stale = [f".a.ckpt.tmp-{dead}-0123abcd", f".last.ckpt.tmp-{os.getpid()}-89abcdef"]
    kept = [
        f".b.ckpt.tmp-{alive}-0123abcd",  # a running process may be saving it right now
        "a.ckpt", ".hidden", f"x.ckpt.tmp-{dead}-0123abcd", f".x.ckpt.tmp-{dead}-zzzzzzzz", "notes.txt",
    ]  # fmt: skip
    for name in stale + kept:
        (tmp_path / name).write_text("x")
    (tmp_path / f".ds.ckpt.tmp-{dead}-00000000").mkdir()  # a DeepSpeed folder whose removal was cut short
    (tmp_path / f".ds.ckpt.tmp-{dead}-00000000" / "latest").write_text("checkpoint")
    stale.append(f".ds.ckpt.tmp-{dead}-00000000")
    assert sorted(os.path.basename(p) for p in remove_stale_temp_files(str(tmp_path))) == sorted(stale)
    assert sorted(os.listdir(tmp_path)) == sorted(kept)
    assert remove_stale_temp_files(str(tmp_path / "missing")) == []


def test_remove_checkpoint_handles_files_links_and_folders(tmp_path):
    io = AtomicCheckpointIO()
    (tmp_path / "a.ckpt").write_text("x")
    (tmp_path / "ds.ckpt").mkdir()
    (tmp_path / "ds.ckpt" / "latest").write_text("checkpoint")
    (tmp_path / "last.ckpt").symlink_to("ds.ckpt")
    io.remove_checkpoint(tmp_path / "last.ckpt")  # the link goes, not the folder it points to
    assert sorted(os.listdir(tmp_path)) == ["a.ckpt", "ds.ckpt"]
    assert (tmp_path / "ds.ckpt" / "latest").exists()
    io.remove_checkpoint(tmp_path / "ds.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "never-there.ckpt")
    assert os.listdir(tmp_path) == []


# Completeness and the finite check


def test_incomplete_reason_tells_complete_from_cut_short(tmp_path):
    path = tmp_path / "a.ckpt"
    torch.save({"state_dict": {"w": torch.randn(64, 64)}, "global_step": 3}, path)
    assert incomplete_reason(str(path)) is None
    data = path.read_bytes()
    for cut in [0, 1, len(data) // 2, len(data) - 1]:
        (tmp_path / "cut.ckpt").write_bytes(data[:cut])
        assert incomplete_reason(str(tmp_path / "cut.ckpt")) is not None, cut
    (tmp_path / "dangling.ckpt").symlink_to("gone.ckpt")
    assert "FileNotFoundError" in incomplete_reason(str(tmp_path / "dangling.ckpt"))
    (tmp_path / "ds.ckpt").mkdir()
    assert "exgrpo-complete" in incomplete_reason(str(tmp_path / "ds.ckpt"))
    # DeepSpeed's own tag file: rank 0 writes it before the other ranks have finished their shards.
    (tmp_path / "ds.ckpt" / "latest").write_text("checkpoint")
    assert incomplete_reason(str(tmp_path / "ds.ckpt")) is not None
    mark_complete(str(tmp_path / "ds.ckpt"))
    assert incomplete_reason(str(tmp_path / "ds.ckpt")).startswith("checkpoint/: the folder")
    (tmp_path / "ds.ckpt" / "checkpoint").mkdir()
    torch.save({"module": {}}, tmp_path / "ds.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt")
    assert incomplete_reason(str(tmp_path / "ds.ckpt")) is None


FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@settings(max_examples=60)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    dtype=st.sampled_from(FLOATS),
    bad=st.none() | st.tuples(st.integers(0, 4), st.integers(0, 39), st.sampled_from(["nan", "inf", "-inf"])),
)  # fmt: skip
def test_check_finite_names_the_first_non_finite_parameter(sizes, dtype, bad):
    state = {f"p{i}": (torch.randn(n) * 100).to(dtype) for i, n in enumerate(sizes)}
    state["steps"] = torch.tensor([7])  # integer tensors are not weights
    if bad is not None and bad[0] < len(sizes) and bad[1] < sizes[bad[0]]:
        state[f"p{bad[0]}"][bad[1]] = float(bad[2])
        first = min(i for i, n in enumerate(sizes) if not torch.isfinite(state[f"p{i}"]).all())
        with pytest.raises(NonFiniteCheckpointError, match=rf"x\.ckpt: parameter 'p{first}' has"):
            check_finite(state, "x.ckpt")
    else:
        check_finite(state, "x.ckpt")


def test_non_finite_weights_are_refused_and_existing_checkpoints_untouched(tmp_path, tiny_model_dir):
    class Poison(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 3:
                next(pl_module.policy.parameters()).data[0, 0] = float("nan")

    directory = tmp_path / "ckpts"
    checkpoint = SafeModelCheckpoint(directory, every_n_train_steps=1)
    with pytest.raises(NonFiniteCheckpointError) as error:
        fit(tmp_path, tiny_model_dir, [Poison(), checkpoint], max_steps=5)
    message = str(error.value)
    assert f"{directory}/epoch=0-step=3.ckpt:" in message and "'policy.model.embed_tokens.weight'" in message
    assert os.listdir(directory) == ["epoch=0-step=2.ckpt"]
    assert step_of(directory / "epoch=0-step=2.ckpt") == 2


def test_held_parameters_reads_a_zero3_partition_instead_of_its_empty_placeholder():
    module = torch.nn.Linear(2, 2)
    module.weight.data = torch.empty(0)  # what ZeRO-3 leaves in a partitioned parameter
    module.weight.ds_tensor = torch.tensor([1.0, float("nan")])  # this rank's partition
    held = held_parameters(module)
    assert held["weight"] is module.weight.ds_tensor and held["bias"] is module.bias
    assert first_non_finite(held) == "weight" and first_non_finite(dict(module.named_parameters())) is None


@pytest.mark.multiprocess
def test_under_ddp_every_rank_refuses_when_any_ranks_weights_are_non_finite(tmp_path, tiny_model_dir):
    """Only rank 0 writes; weights gone bad on rank 1 alone must stop the save too (and every rank raises,
    rather than the others waiting for rank 0 in the save's barrier)."""

    class PoisonRankOne(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 3 and trainer.global_rank == 1:
                next(pl_module.policy.parameters()).data[0, 0] = float("nan")

    directory = tmp_path / "ckpts"
    checkpoint = SafeModelCheckpoint(directory, every_n_train_steps=1)
    with pytest.raises(Exception, match="NonFiniteCheckpointError"):
        fit(
            tmp_path,
            tiny_model_dir,
            [PoisonRankOne(), checkpoint],
            max_steps=5,
            devices=2,
            strategy="ddp_fork",
        )
    assert os.listdir(directory) == ["epoch=0-step=2.ckpt"]


# Resuming from "last"


@pytest.mark.parametrize("save_last", [True, "link"])
def test_last_skips_an_incomplete_checkpoint_for_the_newest_complete_one(tmp_path, tiny_model_dir, save_last):
    directory = tmp_path / "ckpts"
    checkpoint = SafeModelCheckpoint(directory, every_n_train_steps=1, save_last=save_last, save_top_k=-1)
    fit(tmp_path, tiny_model_dir, [checkpoint], max_steps=3)
    last, newest = directory / "last.ckpt", directory / "epoch=0-step=3.ckpt"
    if save_last is True:
        last.write_bytes(last.read_bytes()[:1000])  # cut short, as a copy from another filesystem was
    newest.write_bytes(b"")  # (and under save_last="link", last.ckpt points at it)
    stale_temp = directory / f".last.ckpt.tmp-{dead_pid()}-0123abcd"
    stale_temp.write_bytes(b"half")

    resumed = SafeModelCheckpoint(directory, every_n_train_steps=1)
    with pytest.warns(
        UserWarning, match=r"skipping incomplete or corrupt .*step=3\.ckpt .*; using .*step=2\.ckpt"
    ) as warned:
        trainer = fit(tmp_path, tiny_model_dir, [resumed], "last", max_steps=4)
    assert trainer.ckpt_path == str(directory / "epoch=0-step=2.ckpt")
    if save_last is True:
        assert any("last.ckpt (BadZipFile" in str(w.message) for w in warned)
    assert trainer.global_step == 4 and step_of(directory / "epoch=0-step=4.ckpt") == 4
    assert not stale_temp.exists()


def test_last_without_any_complete_checkpoint_starts_fresh_and_says_why(tmp_path, tiny_model_dir):
    directory = tmp_path / "ckpts"
    directory.mkdir()
    (directory / "last.ckpt").write_bytes(b"")
    with pytest.warns(UserWarning, match=r"no complete, intact checkpoint.*last.ckpt \(BadZipFile"):
        trainer = fit(tmp_path, tiny_model_dir, [SafeModelCheckpoint(directory)], "last", max_steps=1)
    assert trainer.ckpt_path is None and trainer.global_step == 1


def test_loading_an_incomplete_file_names_it(tmp_path):
    (tmp_path / "a.ckpt").write_bytes(b"PK\x03\x04 cut")
    with pytest.raises(RuntimeError, match=r"a.ckpt cannot be resumed from \(BadZipFile"):
        AtomicCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut"], ids=["empty", "truncated"])
def test_an_incomplete_ckpt_path_is_named_before_anything_runs(tmp_path, content):
    (tmp_path / "a.ckpt").write_bytes(content)
    with pytest.raises(
        ValueError, match=r"--ckpt_path=.*a.ckpt: not a complete, intact checkpoint \(BadZipFile"
    ):
        main(["fit", "--ckpt_path", str(tmp_path / "a.ckpt"), f"--trainer.default_root_dir={tmp_path}"])
    check_loadable(tmp_path / "missing.ckpt")  # left to the loader, as are "last" and URLs
    check_loadable("last")


def test_a_plain_state_dict_as_ckpt_path_says_what_it_is_before_anything_is_built(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"model.embed_tokens.weight": torch.ones(3, 2), "lm_head.weight": torch.ones(3, 2)}, path)
    what = r"weights\.pt: a plain state_dict \(2 tensors, the first 'model.embed_tokens.weight'\), not a"
    with pytest.raises(
        NotALightningCheckpointError, match=rf"--ckpt_path=.*{what}.*--model.model_name_or_path"
    ):
        main(["fit", "--ckpt_path", str(path), f"--trainer.default_root_dir={tmp_path}"])
    assert not (tmp_path / "lightning_logs").exists()
    # The writer's loader reads one as it is: Lightning's spawn launcher hands the weights back that way
    assert set(AtomicCheckpointIO().load_checkpoint(path)) == {"model.embed_tokens.weight", "lm_head.weight"}
    torch.save({"model": {"w": torch.ones(1)}, "step": 3}, tmp_path / "other.pt")
    with pytest.raises(
        NotALightningCheckpointError, match=r"a dict of 2 entries \('model', 'step'\) without"
    ):
        check_loadable(tmp_path / "other.pt")


class WritesMarker:
    """A harmless payload: unpickling it creates the file `marker` (as a malicious one would run code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def payload(tmp_path):
    marker = tmp_path / "payload-ran"
    torch.save({"state_dict": {}, "global_step": 1, "evil": WritesMarker(marker)}, tmp_path / "evil.ckpt")
    return tmp_path / "evil.ckpt", marker


def test_a_local_checkpoint_naming_code_is_refused_unrun(payload):
    path, marker = payload
    with pytest.raises(UnsafeCheckpointError, match=r"evil.ckpt.*GLOBAL io.open"):
        AtomicCheckpointIO().load_checkpoint(path)
    assert not marker.exists()


def test_a_checkpoint_url_naming_code_is_refused_unrun(payload, monkeypatch, tmp_path):
    path, marker = payload
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))  # where torch.hub caches the download
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(path.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.timeout = 10
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/{path.name}"
        with pytest.raises(UnsafeCheckpointError, match=r"http://127.0.0.1.*evil.ckpt"):
            AtomicCheckpointIO().load_checkpoint(url)
    finally:
        server.shutdown()
        server.server_close()
    assert not marker.exists()


# Saving when training ends


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        trainer.should_stop = trainer.global_step >= self.step


STOPS = [
    ({"max_steps": 3}, 0, 3),  # an epoch is 14 steps
    ({"max_epochs": 2, "limit_train_batches": 1}, 1, 2),
    ({"callbacks": [StopAt(2)]}, 0, 2),
]


@pytest.mark.parametrize(
    "stop, epoch, step",
    STOPS,
    ids=["max_steps mid-epoch", "max_epochs", "callback should_stop"],
)
def test_the_run_saves_when_it_ends_whatever_stopped_it(tmp_path, tiny_model_dir, stop, epoch, step):
    kwargs = {"max_steps": 50, **stop}
    extra = kwargs.pop("callbacks", [])
    # No periodic save reaches the final step: only the save at train end can.
    checkpoint = SafeModelCheckpoint(tmp_path / "ckpts", every_n_train_steps=100, save_last="link")
    fit(tmp_path, tiny_model_dir, [checkpoint, *extra], **kwargs)
    (saved,) = [p for p in (tmp_path / "ckpts").iterdir() if not p.is_symlink()]
    assert step_of(saved) == step and (tmp_path / "ckpts" / "last.ckpt").resolve() == saved
    assert saved.name == f"epoch={epoch}-step={step}.ckpt"  # the epoch the last step was in


def test_lightning_alone_saves_nothing_in_that_case(tmp_path, tiny_model_dir):
    fit(tmp_path, tiny_model_dir, [ModelCheckpoint(tmp_path / "ckpts", every_n_train_steps=100)], max_steps=3)
    assert not (tmp_path / "ckpts").exists()


# A crash or a full disk


class Crash(Callback):
    """Keeps the bytes of every checkpoint in `directory` at the start of batch `batch`; raises there too
    unless `raise_there` is False."""

    def __init__(self, directory, batch, raise_there=True):
        self.directory, self.batch, self.raise_there, self.before = directory, batch, raise_there, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch:
            self.before = {p.name: p.read_bytes() for p in self.directory.iterdir()}
            if self.raise_there:
                raise RuntimeError("a reward function failed")


def test_out_of_space_is_found_behind_torchs_runtime_error(tmp_path):
    path = str(tmp_path / "a.ckpt")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None
    except RuntimeError as err:
        assert err.__cause__ is None and isinstance(err.__context__, OSError)
        with pytest.raises(OutOfSpaceError, match=r"a.ckpt: it needs at least 2.0 MiB"):
            raise_if_out_of_space(err, path, 2 * 2**20)
    raise_if_out_of_space(RuntimeError("unexpected pos"), path, 2 * 2**20)  # not about space: left alone


def test_an_error_before_the_first_step_is_not_said_to_stop_a_step_halfway(tmp_path, tiny_model_dir, recwarn):
    trainer = Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path,
        callbacks=[SafeModelCheckpoint(tmp_path / "ckpts")],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), batch_size=4)
    with pytest.raises(ValueError, match="num_generations=1000000000: a training step"):  # in setup
        trainer.fit(tiny_module(tiny_model_dir, num_generations=10**9), data)
    assert not [w for w in recwarn if "Training stopped at step" in str(w.message)]


def test_an_exception_in_training_saves_nothing_says_why_and_keeps_the_checkpoints(tmp_path, tiny_model_dir):
    directory = tmp_path / "ckpts"
    crash = Crash(directory, batch=3)
    checkpoint = SafeModelCheckpoint(directory, every_n_train_steps=2, save_last="link")
    warning = r"stopped at step 3 by RuntimeError.*step=2.ckpt \(step 2\).*step 2, redoing the 1 finished"
    with pytest.warns(UserWarning, match=warning):
        with pytest.raises(RuntimeError, match="a reward function failed"):
            fit(tmp_path, tiny_model_dir, [checkpoint, crash], max_steps=6)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == crash.before
    assert sorted(crash.before) == ["epoch=0-step=2.ckpt", "last.ckpt"]


def test_a_full_disk_is_named_with_the_space_needed_and_the_checkpoints_stay(
    tmp_path, tiny_model_dir, monkeypatch
):
    directory = tmp_path / "ckpts"
    real_save = torch.save

    def fills_the_disk(checkpoint, file):
        if checkpoint["global_step"] < 4:
            return real_save(checkpoint, file)
        file.write(b"PK partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", fills_the_disk)
    crash = Crash(directory, batch=3, raise_there=False)
    checkpoint = SafeModelCheckpoint(directory, every_n_train_steps=2, save_last="link")
    message = (
        r"No space left to write .*epoch=0-step=4.ckpt: it needs at least \d+\.\d [KM]iB and .* MiB is free"
    )
    with pytest.warns(UserWarning, match=r"stopped at step 4 by OutOfSpaceError"):
        with pytest.raises(OutOfSpaceError, match=message):
            fit(tmp_path, tiny_model_dir, [checkpoint, crash], max_steps=6)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == crash.before  # no temp file either
    assert step_of(directory / "last.ckpt") == 2


def test_files_written_together_are_all_replaced_or_none_is(tmp_path, monkeypatch):
    paths = [tmp_path / "test.json", tmp_path / "test.md"]
    for path in paths:
        path.write_text(f"previous {path.name}")
    fill_the_disk_for(monkeypatch, "test.md")  # test.md and its temp file find the disk full
    with pytest.raises(OutOfSpaceError, match=r"No space left to write .*test\.md: it needs at least"):
        write_files_atomically({paths[0]: '{"new": 1}\n', paths[1]: "| new |\n"})
    monkeypatch.undo()
    assert [path.read_text() for path in paths] == ["previous test.json", "previous test.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test.json", "test.md"]  # no temp file left
    write_files_atomically({paths[0]: '{"new": 1}\n', paths[1]: "| new |\n"})
    assert [path.read_text() for path in paths] == ['{"new": 1}\n', "| new |\n"]


# The last.ckpt link


def test_the_last_link_is_never_missing_nor_dangling(tmp_path, tiny_model_dir, monkeypatch):
    directory = tmp_path / "ckpts"
    seen = []
    remove, unlink = os.remove, os.unlink

    def watched_remove(path, *args, **kwargs):
        assert os.path.basename(path) != "last.ckpt", "last.ckpt removed before its replacement exists"
        if os.path.dirname(path) == str(directory):
            seen.append((os.path.basename(path), os.path.basename(os.path.realpath(directory / "last.ckpt"))))
        return remove(path, *args, **kwargs)

    monkeypatch.setattr(os, "remove", watched_remove)
    monkeypatch.setattr(os, "unlink", watched_remove)
    checkpoint = SafeModelCheckpoint(directory, every_n_train_steps=1, save_last="link")
    fit(tmp_path, tiny_model_dir, [checkpoint], max_steps=4)
    monkeypatch.setattr(os, "remove", remove)
    monkeypatch.setattr(os, "unlink", unlink)
    assert [removed for removed, _ in seen] == [f"epoch=0-step={s}.ckpt" for s in (1, 2, 3)]
    assert all(removed != target for removed, target in seen)  # the link had moved on before each removal
    assert os.readlink(directory / "last.ckpt") == "epoch=0-step=4.ckpt"


# SIGKILL during saves


@pytest.fixture
def kill_trials(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import checkpoint_kill

    return checkpoint_kill


def run_kill_trials(kill_trials, model_dir, root, count, other_fs, seed):
    if other_fs:
        if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(root).st_dev:
            pytest.skip("needs /dev/shm on another filesystem than the checkpoints (tmp_path)")
        tmp_base = Path(tempfile.mkdtemp(dir="/dev/shm"))
    else:
        tmp_base = root / "tmp"
    rng, trials = random.Random(seed), []
    try:
        for i in range(count):
            save_last = "link" if i % 2 else True
            tmpdir = str(tmp_base / f"{i}")
            trials.append(kill_trials.trial(model_dir, str(root / f"t{i}"), "exgrpo", save_last, tmpdir, rng))
    finally:
        if other_fs:
            shutil.rmtree(tmp_base)
    print(kill_trials.summarize(trials))
    for t in trials:
        assert t["tmpdir_other_fs"] is other_fs and t["killed_exitcode"] == -9, t
        assert t["after_kill"]["unloadable"] == [] and t["after_kill"]["dangling"] == [], t
        assert t["tmpdir_orphans"] == 0, t
        assert t["resume"] == "resumed", t
        assert t["after_resume"]["temp_files"] == [], t
    return trials


@pytest.mark.parametrize("other_fs", [True, False], ids=["TMPDIR on tmpfs", "TMPDIR beside"])
def test_a_kill_during_saves_leaves_no_truncated_checkpoint(kill_trials, tiny_model_dir, tmp_path, other_fs):
    run_kill_trials(kill_trials, tiny_model_dir, tmp_path, 2 if other_fs else 1, other_fs, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("other_fs", [True, False], ids=["TMPDIR on tmpfs", "TMPDIR beside"])
def test_kill_trials_many(kill_trials, tiny_model_dir, tmp_path, other_fs):
    trials = run_kill_trials(kill_trials, tiny_model_dir, tmp_path, 12, other_fs, seed=2)
    assert sum(bool(t["killed_mid_write"]) for t in trials) >= 4  # the kills did land inside writes
    assert sum(len(t["after_kill"]["temp_files"]) > 0 for t in trials) >= 1  # and cut some short

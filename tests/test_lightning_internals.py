"""exgrpo_pl.lightning_internals holds every use of Lightning's private API; these tests fail when the
installed Lightning no longer has what it relies on (a name, a signature, a call site, a state layout), or
when its version leaves the range it was checked against, before the behaviour silently falls back to
Lightning's own. After checking a new Lightning release, widen `CHECKED_VERSIONS`."""

import ast
import inspect
import re
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.trainer.connectors import data_connector
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.combined_loader import _SUPPORTED_MODES
from packaging.version import Version

from exgrpo_pl import lightning_internals
from exgrpo_pl.lightning_internals import CHECKED_VERSIONS, ModelCheckpointHooks

ROOT = Path(__file__).parents[1]


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_the_installed_lightning_is_a_checked_version():
    low, high = (Version(v) for v in CHECKED_VERSIONS)
    assert low <= Version(lightning.__version__) < high, (
        f"Lightning {lightning.__version__} is outside {CHECKED_VERSIONS}, the releases whose private API "
        "exgrpo_pl/lightning_internals.py was checked against: check each entry there, then widen the range"
    )


def test_model_checkpoint_private_methods_keep_their_names_signatures_and_call_sites():
    expected = {
        "_save_checkpoint": ["self", "trainer", "filepath"],
        "_find_last_checkpoints": ["self", "trainer"],
        "_link_checkpoint": ["trainer", "filepath", "linkpath"],
        "_remove_checkpoint": ["self", "trainer", "filepath"],
        "_should_skip_saving_checkpoint": ["self", "trainer"],
        "_monitor_candidates": ["self", "trainer"],
        "_save_topk_checkpoint": ["self", "trainer", "monitor_candidates"],
        "_save_last_checkpoint": ["self", "trainer", "monitor_candidates"],
    }
    for name, names in expected.items():
        assert parameters(getattr(ModelCheckpoint, name)) == names, name
    assert isinstance(inspect.getattr_static(ModelCheckpoint, "_link_checkpoint"), staticmethod)
    callback = ModelCheckpoint()
    assert (callback._last_checkpoint_saved, callback._last_global_step_saved) == ("", 0)
    # ckpt_path="last" asks every ModelCheckpoint; `_link_checkpoint` is called once, on the instance, with
    # these arguments (so an instance method receives the same); every save records what it saved.
    resolve = inspect.getsource(_CheckpointConnector._parse_ckpt_path)
    assert "callback._find_last_checkpoints(self.trainer)" in resolve
    source = inspect.getsource(ModelCheckpoint)
    assert len(re.findall(r"\b_link_checkpoint\(", source)) == 2  # its definition and one call
    assert "self._link_checkpoint(trainer, self._last_checkpoint_saved, filepath)" in inspect.getsource(
        ModelCheckpoint._save_last_checkpoint
    )
    save = inspect.getsource(ModelCheckpoint._save_checkpoint)
    assert "trainer.save_checkpoint(" in save and "self._last_checkpoint_saved = filepath" in save


class Recorder(ModelCheckpointHooks):
    def __init__(self, calls, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = calls

    def before_save(self, trainer, filepath):
        self.calls.append(("before_save", Path(filepath).name))

    def after_save(self, trainer, filepath):
        self.calls.append(("after_save", Path(filepath).name, Path(filepath).exists()))

    def find_last_checkpoints(self, trainer):
        self.calls.append(("find_last_checkpoints",))
        return super().find_last_checkpoints(trainer)

    def link_checkpoint(self, trainer, filepath, linkpath):
        self.calls.append(("link_checkpoint", Path(filepath).name, Path(linkpath).name))
        super().link_checkpoint(trainer, filepath, linkpath)

    def before_remove(self, trainer, filepath):
        self.calls.append(("before_remove", Path(filepath).name))


def boring_fit(root, callback, max_steps, ckpt_path=None):
    trainer = Trainer(
        max_steps=max_steps, limit_train_batches=2, limit_val_batches=0, accelerator="cpu", logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root, callbacks=[callback],
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return trainer


def test_lightning_calls_the_checkpoint_hooks_where_the_private_methods_were(tmp_path):
    calls = []
    hooks = Recorder(calls, dirpath=tmp_path, every_n_train_steps=1, save_top_k=1, save_last="link")
    boring_fit(tmp_path, hooks, max_steps=2)
    assert calls == [
        ("before_save", "epoch=0-step=1.ckpt"),
        ("after_save", "epoch=0-step=1.ckpt", True),
        ("link_checkpoint", "epoch=0-step=1.ckpt", "last.ckpt"),
        ("before_save", "epoch=0-step=2.ckpt"),
        ("after_save", "epoch=0-step=2.ckpt", True),
        ("before_remove", "epoch=0-step=1.ckpt"),
        ("link_checkpoint", "epoch=0-step=2.ckpt", "last.ckpt"),
    ]
    assert hooks.last_checkpoint_saved == str(tmp_path / "epoch=0-step=2.ckpt")
    assert hooks.last_global_step_saved == 2
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    calls.clear()
    trainer = boring_fit(tmp_path, Recorder(calls, dirpath=tmp_path), max_steps=3, ckpt_path="last")
    assert calls[0] == ("find_last_checkpoints",)  # and, returning None, Lightning's own lookup ran
    assert Path(trainer.ckpt_path).name == "last.ckpt"


def test_the_fit_loop_state_keeps_the_layout_resumable_fit_progress_rewrites(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    boring_fit(tmp_path, callback, max_steps=3)
    checkpoint = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)  # the epoch's last batch
    loop = checkpoint["loops"][lightning_internals._FIT]
    for key in (lightning_internals._EPOCHS, lightning_internals._BATCHES, lightning_internals._VAL_BATCHES):
        for counts in ("total", "current"):
            assert set(loop[key][counts]) >= set(lightning_internals._KEYS), (key, counts)
    assert isinstance(loop[lightning_internals._BATCHES]["is_last_batch"], bool)
    assert loop[lightning_internals._BATCHES]["is_last_batch"]
    assert loop[lightning_internals._LOOP_STATE]["_batches_that_stepped"] == 1  # the batch not counted yet
    assert lightning_internals.resumable_fit_progress(checkpoint) == "epoch end"
    assert loop[lightning_internals._EPOCHS]["total"] == dict.fromkeys(lightning_internals._KEYS, 1)
    assert loop[lightning_internals._LOOP_STATE]["_batches_that_stepped"] == 2
    mid_epoch = torch.load(tmp_path / "epoch=1-step=3.ckpt", weights_only=True)
    assert lightning_internals.resumable_fit_progress(mid_epoch) is None  # Lightning resumes it exactly


def test_the_loops_keep_the_private_attributes_relied_on():
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    fit_loop, epoch_loop = trainer.fit_loop, trainer.fit_loop.epoch_loop
    assert isinstance(fit_loop, _FitLoop) and isinstance(epoch_loop, _TrainingEpochLoop)
    assert fit_loop._data_fetcher is None and fit_loop._combined_loader_states_to_load == []
    assert fit_loop._data_source.name == "train_dataloader"
    assert epoch_loop._batches_that_stepped == 0 and lightning_internals.batches_that_stepped(trainer) == 0
    assert (epoch_loop.restarting, epoch_loop.restarted_on_last) == (False, False)
    assert parameters(_TrainingEpochLoop._should_check_val_fx) == ["self", "data_fetcher"]
    assert isinstance(inspect.getattr_static(_LoggerConnector, "should_update_logs"), property)
    assert isinstance(lightning_internals.should_update_logs(trainer), bool)
    assert not lightning_internals.loader_states_pending(trainer)


def test_the_data_connector_helpers_keep_their_signatures():
    assert parameters(data_connector._request_dataloader) == ["data_source"]
    assert parameters(data_connector._process_dataloader) == ["trainer", "trainer_fn", "stage", "dataloader"]
    assert parameters(data_connector._parse_num_batches) == ["stage", "length", "limit_batches"]
    combined = CombinedLoader([range(3), range(5)], "max_size_cycle")
    assert combined._mode == "max_size_cycle"
    assert _SUPPORTED_MODES[combined._mode]["fn"]([3, 5]) == 5


def test_the_module_and_strategy_attributes_relied_on_are_there():
    module = LightningModule()
    assert module._trainer is None and lightning_internals.attached_trainer(module) is None
    with pytest.raises(RuntimeError, match="not attached"):
        module.trainer  # noqa: B018 - the public property raises where attached_trainer gives None
    assert "self._config_initialized = False" in inspect.getsource(DeepSpeedStrategy.__init__)
    assert "self._config_initialized = True" in inspect.getsource(DeepSpeedStrategy._init_config_if_needed)
    assert lightning_internals.deepspeed_config_filled_in(object()) is False


@pytest.mark.parametrize("strategy, spawns", [("ddp_spawn", True), ("ddp_fork", False), ("ddp", False)])
def test_the_launchers_start_method_is_where_it_was_read(strategy, spawns):
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert lightning_internals.spawns_processes(trainer.strategy) is spawns


def test_a_single_device_trainer_has_the_cluster_environment_its_signal_handlers_read():
    trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    assert not hasattr(trainer.strategy, "cluster_environment")
    assert "_accelerator_connector.cluster_environment" in inspect.getsource(
        type(trainer._signal_connector).register_signal_handlers
    )
    assert (
        lightning_internals.cluster_environment(trainer) is trainer._accelerator_connector.cluster_environment
    )


def test_a_metric_marked_reset_is_left_out_of_what_a_step_writes_until_logged_again():
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    assert "has_reset" in inspect.getsource(_ResultCollection.valid_items)
    assert "has_reset = False" in inspect.getsource(_ResultCollection.update_metrics)
    assert 'key = f"{fx}.{name}"' in inspect.getsource(_ResultCollection.log)
    results = _ResultCollection(training=True)
    results.log("on_train_batch_end", "train/reward", torch.tensor(1.0), on_step=True, on_epoch=False)
    trainer = type("Trainer", (), {"_results": results})()
    lightning_internals.forget_step_metrics(trainer, "on_train_batch_end", ["train/reward", "never/logged"])
    assert "train/reward" not in results.metrics(on_step=True)["log"]
    results.log("on_train_batch_end", "train/reward", torch.tensor(0.5), on_step=True, on_epoch=False)
    assert results.metrics(on_step=True)["log"]["train/reward"] == 0.5


def private_names(*objects) -> set[str]:
    return {
        name for obj in objects for name in dir(obj) if name.startswith("_") and not name.startswith("__")
    }


def lightning_private_names() -> set[str]:
    """Private attributes (one leading underscore) of the Lightning objects exgrpo-pl touches, less those of
    the torch classes they extend (`nn.Module`, `DataLoader`), which are torch's, not Lightning's."""
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    lightning_objects = [
        trainer, trainer.fit_loop, trainer.fit_loop.epoch_loop, trainer.strategy, ModelCheckpoint(),
        LightningModule(), DeepSpeedStrategy, CombinedLoader([range(1)]),
    ]  # fmt: skip
    torch_objects = [torch.nn.Module(), torch.utils.data.DataLoader(range(1))]
    return private_names(*lightning_objects) - private_names(*torch_objects)


def test_no_other_module_uses_lightnings_private_api():
    """Outside exgrpo_pl/lightning_internals.py, no file imports a private name from Lightning or reads a
    private attribute of the Lightning objects above that the package does not set itself."""
    private = lightning_private_names()
    files = [*sorted((ROOT / "exgrpo_pl").rglob("*.py")), *sorted((ROOT / "callbacks").rglob("*.py"))]
    files.remove(ROOT / "exgrpo_pl" / "lightning_internals.py")
    trees = {path: ast.parse(path.read_text()) for path in files}
    own = {  # what the package sets on its own objects (self._x = ...) and the methods it defines
        target.attr
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    } | {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
                found += [f"{path.name}: imports {a.name}" for a in node.names if a.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in private - own:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.Constant) and node.value in private - own:  # getattr(obj, "_name")
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    assert not found, found

"""The `exgrpo` command: fit, validate and test run end to end on a tiny model and say where things are;
checkpoints are kill-proof by default, saved when a run stops and found by `--ckpt_path last`."""

import json
import os
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import torch
from conftest import fill_the_disk_for
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl import moved
from exgrpo_pl.callbacks import DifficultyMonitor, ReplayCallback
from exgrpo_pl.checkpoints import AtomicCheckpointIO, SafeModelCheckpoint
from exgrpo_pl.checkpoints.saving import OutOfSpaceError
from exgrpo_pl.cli import ExGRPOCLI, dashboard_link, main
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.experience import TrajectoryBuffer
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.moved import REMOVED_IN, ModuleMovedError, MovedModuleWarning
from exgrpo_pl.renamed import RenamedConfigError, RenamedConfigWarning


@pytest.fixture
def tiny_args(tiny_model_dir, tmp_path):
    return [
        f"--model.model_name_or_path={tiny_model_dir}", "--model.num_generations=2",
        "--model.max_completion_length=3", "--data.synthetic=exgrpo_pl.data.ArithmeticTask",
        "--data.synthetic.num_questions=40", "--data.batch_size=4", "--trainer.accelerator=cpu",
        "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip


def test_fit_prints_logs_and_checkpoint(tiny_args, tmp_path, capsys):
    main(["fit", *tiny_args, "--trainer.max_steps=2", "--trainer.log_every_n_steps=1"])
    out = capsys.readouterr().out
    assert "Training finished." in out and "tensorboard --logdir" in out and ".ckpt" in out
    # The default logger writes where Lightning's would, without the placeholder `hp_metric` chart, and
    # Lightning's `epoch` in the train group, where it does not take one of the two groups TensorBoard opens.
    (run,) = (tmp_path / "lightning_logs").glob("run-s0")  # no config file: `run`, and the default seed 0
    events = EventAccumulator(str(run))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "train/reward" in scalars and "hp_metric" not in scalars
    assert "epoch" not in scalars and "train/epoch" in scalars


def test_fit_ends_with_a_tensorboard_link_pinning_charts_the_run_logged(tiny_args, tmp_path, capsys):
    replay_and_monitor = [
        "--trainer.callbacks+=exgrpo_pl.callbacks.ReplayCallback",
        "--trainer.callbacks.mode=mix",
        "--trainer.callbacks.min_buffer_size=1",
        "--trainer.callbacks+=exgrpo_pl.callbacks.DifficultyMonitor",
        "--trainer.callbacks.log_every_n_steps=1",
    ]
    args = ["--model.validate_at_start=true", "--trainer.max_steps=2", "--trainer.log_every_n_steps=1"]
    main(["fit", *tiny_args, *replay_and_monitor, *args])
    out = capsys.readouterr().out
    # Printed when training starts, to watch it run, and again when it ends.
    start, end = [line.split("then open ")[1] for line in out.splitlines() if "then open " in line]
    assert start == end and out.index("Training starts.") < out.index(start) < out.index("Training finished.")
    link = start
    url = urlsplit(link)
    assert (url.netloc, url.fragment) == ("localhost:6006", "timeseries")
    cards = json.loads(parse_qs(url.query)["pinnedCards"][0])
    assert parse_qs(url.query)["smoothing"] == ["0"]  # the charts' lines are the values logged
    (run,) = (tmp_path / "lightning_logs").glob("run-s0")
    events = EventAccumulator(str(run), size_guidance={"images": 0})
    events.Reload()
    pinned = {card["plugin"]: [] for card in cards}
    for card in cards:
        pinned[card["plugin"]].append(card["tag"])
    assert pinned["scalars"] == ["val/pass@1", "train/reward", "train/replayed_share"]
    assert set(pinned["scalars"]) <= set(events.Tags()["scalars"])
    # The image cards (the validation curve's picture, the heatmap) name this run as TensorBoard does when
    # given the folder above it.
    images = [card for card in cards if card["plugin"] == "images"]
    assert [card["tag"] for card in images] == ["val/pass@1_curve", "monitor/difficulty_entropy_heatmap"]
    for image in images:
        assert image["tag"] in events.Tags()["images"] and image["runId"] == f"defaultExperimentId/{run.name}"


def test_the_docs_show_the_link_the_quickstart_prints():
    link = dashboard_link("quickstart-s0", [ReplayCallback(), DifficultyMonitor()])  # the quickstart's
    root = Path(__file__).parents[1]
    assert link in (root / "README.md").read_text() and link in (root / "docs" / "dashboards.md").read_text()


@pytest.mark.parametrize("subcommand, metric", [("validate", "val/pass@1"), ("test", "test/pass@1")])
def test_validate_and_test_report_pass_at_1(tiny_args, subcommand, metric, capsys):
    main([subcommand, *tiny_args])
    assert metric in capsys.readouterr().out


def test_help_lists_export_beside_the_trainer_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "fit" in help_text and "exgrpo export --ckpt_path X.ckpt --out DIR" in help_text


def _cli(tiny_args, *extra, run=False):
    args = ["fit", *tiny_args, *extra] if run else [*tiny_args, *extra]
    return ExGRPOCLI(ExGRPOModule, PromptDataModule, run=run, args=args)


def test_checkpoints_are_kill_proof_by_default(tiny_args):
    trainer = _cli(tiny_args).trainer
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    (checkpoint,) = trainer.checkpoint_callbacks
    assert type(checkpoint) is SafeModelCheckpoint and checkpoint.save_last == "link"


def test_a_configured_checkpoint_io_or_callback_is_kept(tiny_args):
    trainer = _cli(
        tiny_args,
        "--trainer.plugins=lightning.pytorch.plugins.io.AsyncCheckpointIO",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=7",
    ).trainer
    assert type(trainer.strategy.checkpoint_io) is AsyncCheckpointIO
    (checkpoint,) = trainer.checkpoint_callbacks
    assert type(checkpoint) is ModelCheckpoint and checkpoint._every_n_train_steps == 7
    assert _cli(tiny_args, "--trainer.enable_checkpointing=false").trainer.checkpoint_callbacks == []


def test_a_deepspeed_preset_builds_with_the_atomic_writer(tiny_model_dir, tmp_path):
    pytest.importorskip("deepspeed")
    preset = Path(__file__).parents[1] / "configs" / "qwen2.5-math-1.5b_zero2.yaml"
    overrides = [
        f"--model.model_name_or_path={tiny_model_dir}", "--model.chat_template=false",
        "--trainer.accelerator=cpu", "--trainer.devices=1", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip
    trainer = ExGRPOCLI(
        ExGRPOModule, PromptDataModule, run=False, args=["--config", str(preset), *overrides]
    ).trainer
    assert isinstance(trainer.strategy, DeepSpeedStrategy)
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO  # used there to remove old checkpoints
    (checkpoint,) = trainer.checkpoint_callbacks
    assert type(checkpoint) is SafeModelCheckpoint and checkpoint.save_last == "link"


def test_a_run_stopped_between_validations_saves_and_the_next_resumes_from_it(tiny_args, tmp_path):
    schedule = ["--trainer.val_check_interval=5", "--trainer.check_val_every_n_epoch=null"]  # as quickstart
    _cli(tiny_args, *schedule, "--trainer.max_steps=3", run=True)
    first = tmp_path / "lightning_logs" / "run-s0" / "checkpoints"
    (saved,) = first.glob("epoch=*-step=3.ckpt")  # no validation ran: only the save at train end made it
    assert os.readlink(first / "last.ckpt") == saved.name

    resumed = _cli(tiny_args, *schedule, "--trainer.max_steps=5", "--ckpt_path=last", run=True).trainer
    assert resumed.ckpt_path == str(saved)  # found in the previous run's version folder
    assert resumed.global_step == 5
    second = tmp_path / "lightning_logs" / "run-s0-v1" / "checkpoints"  # the name kept, numbered
    assert len(list(second.glob("epoch=*-step=5.ckpt"))) == 1


@pytest.mark.slow
def test_quickstart_stopped_at_40_steps_saves_its_checkpoint(tmp_path):
    config = Path(__file__).parents[1] / "configs" / "quickstart.yaml"
    overrides = ["--trainer.max_steps=40", f"--trainer.default_root_dir={tmp_path}"]
    main(["fit", "--config", str(config), *overrides, "--model.validate_at_start=false"])  # saves regardless
    checkpoints = tmp_path / "lightning_logs" / "quickstart-s0" / "checkpoints"
    (saved,) = checkpoints.glob("epoch=*-step=40.ckpt")  # validation (every 50 steps) never ran
    assert os.readlink(checkpoints / "last.ckpt") == saved.name
    assert torch.load(saved, weights_only=True)["global_step"] == 40


@pytest.mark.parametrize("ckpt", ["file", "last"])
def test_a_resumed_run_keeps_its_own_options_and_lists_those_that_differ_from_the_checkpoint(
    tiny_args, tmp_path, ckpt, recwarn
):
    """(A resume with the same options warns about none: tests/checkpoints/test_resume.py.)"""
    _cli(tiny_args, "--trainer.max_steps=2", "--model.learning_rate=1e-3", run=True)
    (saved,) = tmp_path.glob("lightning_logs/run-s0/checkpoints/epoch=*.ckpt")
    path = str(saved) if ckpt == "file" else "last"
    options = ["--model.learning_rate=2e-3", "--model.weight_decay=0.1", f"--ckpt_path={path}"]
    cli = _cli(tiny_args, "--trainer.max_steps=3", *options, run=True)
    (warning,) = [str(w.message) for w in recwarn if "differ from the checkpoint" in str(w.message)]
    assert cli.model.hparams.learning_rate == 2e-3 and cli.model.hparams.weight_decay == 0.1
    # ... and the optimizer, whose restored state held the checkpoint's rate, trained with them
    (group,) = cli.trainer.optimizers[0].param_groups
    assert group["lr"] == group["initial_lr"] == 2e-3 and group["weight_decay"] == 0.1
    assert "2 option(s) differ" in warning
    assert "model.learning_rate: 0.001 in the checkpoint, 0.002 in this run" in warning
    assert "model.weight_decay: 0.0 in the checkpoint, 0.1 in this run" in warning


@pytest.mark.parametrize(
    "option, message",
    [
        ("{mix_fraction: 1.5}", r"^ReplayCallback mix_fraction=1.5: must be in \(0, 1\]$"),
        (
            "{min_buffer_size: 200000}",
            r"^ReplayCallback min_buffer_size=200000: must be <= the buffer's max_size",
        ),
    ],
)
def test_an_invalid_callback_option_is_the_error_alone(tiny_args, option, message):
    callback = (
        f"--trainer.callbacks=[{{class_path: exgrpo_pl.callbacks.ReplayCallback, init_args: {option}}}]"
    )
    with pytest.raises(ValueError, match=message) as raised:
        main(["fit", *tiny_args, callback])
    assert raised.value.__cause__ is None and raised.value.__suppress_context__  # no union dump above it


OLD_CONFIG = (
    "# exgrpo_pl.strategies.check_strategy completes DeepSpeed's config (a comment: not read)\n"
    "trainer:\n"
    "  callbacks:\n"
    "    - class_path: exgrpo_pl.callbacks.ReplayCallback\n"
    "      init_args:\n"
    "        buffer: {class_path: exgrpo_pl.buffer.TrajectoryBuffer}  # exgrpo_pl.update: not read\n"
    "    - class_path: exgrpo_pl.checkpointing.SafeModelCheckpoint\n"
)
OLD_PLUGIN = "--trainer.plugins=exgrpo_pl.checkpointing.AtomicCheckpointIO"


def old_path_lines(config, when):
    checkpoints = "AtomicCheckpointIO and SafeModelCheckpoint import from exgrpo_pl.checkpoints"
    return [
        f"  {config}, line 6: exgrpo_pl.buffer.TrajectoryBuffer: exgrpo_pl.buffer moved to "
        f"exgrpo_pl.experience.buffer; TrajectoryBuffer imports from exgrpo_pl.experience ({when})",
        f"  {config}, line 7: exgrpo_pl.checkpointing.SafeModelCheckpoint: exgrpo_pl.checkpointing moved to "
        f"exgrpo_pl.checkpoints.saving; {checkpoints} ({when})",
        f"  argument {OLD_PLUGIN!r}: exgrpo_pl.checkpointing.AtomicCheckpointIO: exgrpo_pl.checkpointing "
        f"moved to exgrpo_pl.checkpoints.saving; {checkpoints} ({when})",
    ]


@pytest.mark.parametrize("name", ["old.yaml", "old.cfg", "old_config"])
def test_a_config_with_old_module_paths_runs_with_one_warning_naming_each(tiny_args, tmp_path, name):
    """A config of the flat layout, whatever its file's name: one warning lists each old path with its file
    and line (or argument) and the new path, and the run is built with the classes the old paths name."""
    config = tmp_path / name
    config.write_text(OLD_CONFIG)
    with pytest.warns(MovedModuleWarning) as record:
        trainer = _cli(tiny_args, "--config", str(config), OLD_PLUGIN).trainer
    assert str(record[0].message).splitlines() == [
        "exgrpo_pl's modules moved into folders; these old paths still work, with a warning:",
        *old_path_lines(config, f"the old path is deprecated and is removed in exgrpo-pl {REMOVED_IN}"),
    ]
    assert len([w for w in record if issubclass(w.category, MovedModuleWarning)]) == 1
    (replay,) = [c for c in trainer.callbacks if isinstance(c, ReplayCallback)]
    assert type(replay.buffer) is TrajectoryBuffer
    assert type(trainer.checkpoint_callback) is SafeModelCheckpoint
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO


@pytest.mark.parametrize("name", ["old.yaml", "old.cfg"])
def test_after_the_removal_an_old_path_in_a_config_is_a_short_error(tiny_args, tmp_path, monkeypatch, name):
    """Before parsing, whatever the file's name: jsonargparse would bury the first path alone in kilobytes of
    the types it tried."""
    monkeypatch.setattr(moved, "VERSION", REMOVED_IN)
    for old in ("exgrpo_pl.buffer", "exgrpo_pl.checkpointing"):
        monkeypatch.delitem(sys.modules, old, raising=False)
    config = tmp_path / name
    config.write_text(OLD_CONFIG)
    with pytest.raises(ModuleMovedError) as raised:
        main(["fit", "--config", str(config), *tiny_args, OLD_PLUGIN])
    assert str(raised.value).splitlines() == [
        "exgrpo_pl's modules moved into folders; update these paths:",
        *old_path_lines(config, f"the old path was removed in exgrpo-pl {REMOVED_IN}"),
    ]
    assert not (tmp_path / "lightning_logs").exists()


def test_the_swap_presets_old_name_is_read_from_its_new_file_with_a_warning(tiny_args):
    """configs/exgrpo_seed.yaml, renamed configs/exgrpo_swap.yaml: the warning names the new file and the
    version that removes the old name, and the run is the swap preset's."""
    configs = Path(__file__).parents[1] / "configs"
    old, new = configs / "exgrpo_seed.yaml", configs / "exgrpo_swap.yaml"
    with pytest.warns(RenamedConfigWarning) as record:
        trainer = _cli(["--config", str(old), *tiny_args]).trainer
    assert [str(w.message) for w in record if issubclass(w.category, RenamedConfigWarning)] == [
        f"{old} was renamed {new} (the old name is read from the new file and is removed in exgrpo-pl "
        f"{REMOVED_IN})"
    ]
    (replay,) = [c for c in trainer.callbacks if isinstance(c, ReplayCallback)]
    assert (replay.mode, replay.replay.replay_probability, replay.min_buffer_size) == ("swap", 0.3, 1000)


def test_after_the_removal_the_swap_presets_old_name_is_an_error_naming_the_new_file(
    tiny_args, tmp_path, monkeypatch
):
    monkeypatch.setattr(moved, "VERSION", REMOVED_IN)
    configs = Path(__file__).parents[1] / "configs"
    with pytest.raises(RenamedConfigError, match=f"renamed {configs / 'exgrpo_swap.yaml'} .* was removed in"):
        main(["fit", f"--config={configs / 'exgrpo_seed.yaml'}", *tiny_args])
    assert not (tmp_path / "lightning_logs").exists()


@pytest.mark.parametrize("full", ["test.json", "test.md", "config.yaml"])
def test_a_full_disk_leaves_the_previous_runs_report_and_config_whole_and_names_the_file(
    tiny_args, tmp_path, monkeypatch, full
):
    """`exgrpo test` run again into the same folder on a full disk: an error naming the file, and the file
    the previous run's, whole; test.json and test.md are written together: both new or both the previous."""

    def run(questions):
        task = f"{{class_path: exgrpo_pl.data.ArithmeticTask, init_args: {{num_questions: {questions}}}}}"
        held = f"{{held: {{synthetic: {task}}}}}"
        main(["test", *tiny_args, "--trainer.logger=false", f"--data.eval_sets={held}"])

    run(4)
    files = {name: (tmp_path / name).read_text() for name in ("test.json", "test.md", "config.yaml")}
    assert json.loads(files["test.json"])["rows"]["held"]["problems"] == 4
    fill_the_disk_for(monkeypatch, full)
    with pytest.raises(
        OutOfSpaceError, match=rf"No space left to write {tmp_path}/{full}: it needs at least"
    ):
        run(3)
    monkeypatch.undo()
    kept = ["config.yaml"] if full == "config.yaml" else ["test.json", "test.md"]  # config: new, written
    assert {name: (tmp_path / name).read_text() for name in kept} == {name: files[name] for name in kept}
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file left


@pytest.mark.parametrize("config", [None, "grpo_baseline"])
def test_ddp_spawn_is_refused_before_anything_starts_naming_ddp(tiny_args, config):
    """Its processes would unpickle the trainer, model and data (the quickstart's tensors fail to, and so
    does the config writer); `ddp` runs the same command once per device instead."""
    preset = ["--config", str(Path(__file__).parents[1] / "configs" / f"{config}.yaml")] if config else []
    spawn = ["--trainer.strategy=ddp_spawn", "--trainer.devices=2"]
    refused = "ddp_spawn .* not supported by exgrpo; use `--trainer.strategy ddp`"
    with pytest.raises(ValueError, match=refused):
        ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=[*preset, *tiny_args, *spawn])


def test_runs_are_named_after_their_config_and_seed_or_run_name(tiny_args, tmp_path):
    preset = Path(__file__).parents[1] / "configs" / "grpo_baseline.yaml"
    logs = tmp_path / "lightning_logs"
    for _ in range(2):  # the second run of the same config and seed keeps the name, numbered
        _cli(["--config", str(preset), *tiny_args, "--trainer.max_steps=1"], run=True)
    _cli(tiny_args, "--seed_everything=7", "--run_name=lr sweep", "--trainer.max_steps=1", run=True)
    assert sorted(path.name for path in logs.iterdir() if path.is_dir()) == [
        "grpo_baseline-s0",
        "grpo_baseline-s0-v1",
        "lr_sweep",
    ]

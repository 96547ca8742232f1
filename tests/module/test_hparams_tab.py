"""TensorBoard's HParams tab: a run's module and replay options, with the metrics that compare runs, and
the log folder's columns: the options that differ between its runs."""

import pytest
from conftest import tensorboard_experiment, tiny_module
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.module.hparams_tab import FOLDER_SUMMARY, HPARAMS_METRICS, OFF_WITHOUT_REPLAY, run_hparams


def fit(tmp_path, model_dir, callbacks, **options):
    seed_everything(0)
    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)
    trainer = Trainer(
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=callbacks,
    )
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(tiny_module(model_dir, validate_at_start=True, **options), data)
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return events


def session_start(events):
    """The run's options, as TensorBoard reads them (its session start); no run writes an experiment."""
    content = events.PluginTagToContent("hparams")
    assert "_hparams_/experiment" not in content  # the folder's summary holds the columns
    return plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info


def test_a_replay_run_lists_its_replay_options_and_the_metrics_that_compare_runs(tmp_path, tiny_model_dir):
    replay = ReplayCallback(
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0), mode="mix", min_buffer_size=1
    )
    events = fit(tmp_path, tiny_model_dir, [replay])
    start = session_start(events)
    experiment = tensorboard_experiment(tmp_path / "tb")
    assert [m.name.tag for m in experiment.metric_infos] == list(HPARAMS_METRICS)
    assert start.hparams["ReplayCallback.mode"].string_value == "mix"
    assert start.hparams["ReplayCallback.mix_fraction"].number_value == 0.5
    assert start.hparams["ReplayCallback.replay.question_sampling"].string_value == "uniform"
    assert start.hparams["num_generations"].number_value == 4
    # Each metric is a real series of the run; the best is the running maximum of the validations.
    scalars = events.Tags()["scalars"]
    assert set(HPARAMS_METRICS) <= set(scalars) and "hp_metric" not in scalars
    curve = [e.value for e in events.Scalars("val/pass@1")]
    best = [e.value for e in events.Scalars("val/best_pass@1")]
    assert len(curve) == len(best) == 3  # at the start, after steps 2 and 4
    assert best == pytest.approx([max(curve[: i + 1]) for i in range(3)])
    assert events.Scalars("replay/replayed_steps")[-1].value == replay.replayed_steps > 0


def test_the_columns_are_the_options_that_differ_between_the_folders_runs(tmp_path, tiny_model_dir):
    replay = ReplayCallback(replay=SelectiveReplay(strategy="uniform"), mode="mix", min_buffer_size=1)
    grpo = session_start(fit(tmp_path, tiny_model_dir, []))
    exgrpo = session_start(fit(tmp_path, tiny_model_dir, [replay], learning_rate=3e-4, entropy_coef=1e-3))
    # TensorBoard's table opens on the first five options of the experiment it serves (the folder's own):
    # those whose values differ between the two runs, then the rest by name.
    experiment = tensorboard_experiment(tmp_path / "tb")
    differ = [info.name for info in experiment.hparam_infos if info.differs]
    assert differ == [
        "ReplayCallback.mix_fraction",
        "ReplayCallback.mode",
        "ReplayCallback.placement",
        "entropy_coef",
        "learning_rate",
    ]
    assert (tmp_path / "tb" / FOLDER_SUMMARY).is_file()
    # Every run has a value on those axes (parallel coordinates draws both): GRPO's replay is "off".
    assert {name: grpo.hparams[name].WhichOneof("kind") for name in OFF_WITHOUT_REPLAY} == {
        "ReplayCallback.mode": "string_value",
        "ReplayCallback.mix_fraction": "number_value",
        "ReplayCallback.placement": "string_value",
    }
    assert grpo.hparams["ReplayCallback.mode"].string_value == "off"
    assert exgrpo.hparams["ReplayCallback.mode"].string_value == "mix"
    # Options only the replay run has are listed, to tick, without being marked as differing.
    names = {info.name: info for info in experiment.hparam_infos}
    assert not names["ReplayCallback.buffer.max_size"].differs and not names["loss_type"].differs
    assert not [name for name in names if name.split(".")[-1].startswith("_")]


def test_run_hparams_are_plain_values_a_callback_contributes_its_mapping():
    class WithOptions:
        hparams = {"mode": "mix", "sizes": [1, 2]}

    class Without:
        hparams = "not a mapping"

    params = run_hparams({"lr": 1e-3, "dtype": None, "lora": {"r": 8}}, [WithOptions(), Without()])
    assert params == {
        "lr": 1e-3,
        "dtype": "None",
        "lora": "{'r': 8}",
        "WithOptions.mode": "mix",
        "WithOptions.sizes": "[1, 2]",
        **OFF_WITHOUT_REPLAY,  # no ReplayCallback among the callbacks
    }
    assert "_instantiator" not in run_hparams({"_instantiator": "lightning.pytorch.cli.instantiate"}, [])

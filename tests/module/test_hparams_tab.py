"""TensorBoard's HParams tab: a run's module and replay options, with the metrics that compare runs."""

import pytest
from conftest import tiny_module
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import backend_context, plugin_data_pb2

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay
from exgrpo_pl.module.hparams_tab import COMPARED_HPARAMS, HPARAMS_METRICS, run_hparams


def fit(tmp_path, model_dir, callbacks):
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
    trainer.fit(tiny_module(model_dir, validate_at_start=True), data)
    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return events


def hparams_entry(events):
    """(experiment, session start) protos of the run's HParams entry."""
    content = events.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    return experiment, start.session_start_info


def test_a_replay_run_lists_its_replay_options_and_the_metrics_that_compare_runs(tmp_path, tiny_model_dir):
    replay = ReplayCallback(
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0), mode="mix", min_buffer_size=1
    )
    events = fit(tmp_path, tiny_model_dir, [replay])
    experiment, start = hparams_entry(events)
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


def default_columns(experiment, shown=5):
    """The option columns TensorBoard's HParams table shows before any is ticked: its backend sorts the
    experiment's options (`differs` first, then by name) and its table shows the first five."""
    backend_context._sort_and_reduce_to_hparams_limit(experiment)
    return [info.name for info in experiment.hparam_infos[:shown]]


def test_a_grpo_and_an_exgrpo_run_open_on_the_options_that_tell_them_apart(tmp_path, tiny_model_dir):
    replay = ReplayCallback(replay=SelectiveReplay(strategy="uniform"), mode="mix", min_buffer_size=1)
    grpo = fit(tmp_path, tiny_model_dir, [])  # version_0, the run TensorBoard reads first
    exgrpo = fit(tmp_path, tiny_model_dir, [replay])
    (grpo_experiment, grpo_start), (exgrpo_experiment, exgrpo_start) = map(hparams_entry, (grpo, exgrpo))
    # Whichever run's experiment TensorBoard takes for the table, it opens on the same columns.
    assert default_columns(grpo_experiment) == default_columns(exgrpo_experiment) == sorted(COMPARED_HPARAMS)
    assert "learning_rate" in grpo_start.hparams and "ReplayCallback.mode" not in grpo_start.hparams
    assert exgrpo_start.hparams["ReplayCallback.mode"].string_value == "mix"
    assert exgrpo_start.hparams["ReplayCallback.replay.strategy"].string_value == "uniform"
    # The run's other options stay in its experiment, to tick.
    assert "ReplayCallback.buffer.max_size" in {info.name for info in exgrpo_experiment.hparam_infos}


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
    }

"""What docs/dashboards.md promises of TensorBoard, checked in the event files two `exgrpo fit` runs write
into one log folder (the recommended ExGRPO preset and the GRPO baseline, a few steps each): the runs'
names, the HParams columns TensorBoard's own backend serves, and replay's charts."""

from pathlib import Path

import pytest
from conftest import tensorboard_experiment
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from exgrpo_pl.cli import main

CONFIGS = Path(__file__).parents[1] / "configs"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """`lightning_logs` after `exgrpo fit` of configs/exgrpo.yaml and configs/grpo_baseline.yaml, 6 steps of
    8 questions each, replay started at once and fed from the first step (min_buffer_size 1)."""
    root = tmp_path_factory.mktemp("dashboards")
    shared = [
        "--trainer.max_steps=6", "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=3",
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", "--data.batch_size=8",
        "--data.val_batch_size=8", "--model.num_generations=4", "--model.val_num_generations=1",
        f"--trainer.default_root_dir={root}",
    ]  # fmt: skip
    replay = ["--trainer.callbacks.start_pass_rate=null", "--trainer.callbacks.min_buffer_size=1"]
    main(["fit", "--config", str(CONFIGS / "exgrpo.yaml"), *shared, *replay])
    main(["fit", "--config", str(CONFIGS / "grpo_baseline.yaml"), *shared])
    return root / "lightning_logs"


def events(run: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def steps(accumulator: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in accumulator.Scalars(tag)} if tag in accumulator.Tags()["scalars"] else {}


@pytest.mark.slow
def test_two_runs_read_as_their_config_and_seed(logs):
    assert sorted(p.name for p in logs.iterdir() if p.is_dir()) == ["exgrpo-s0", "grpo_baseline-s0"]


@pytest.mark.slow
def test_hparams_opens_on_the_options_that_differ_with_a_value_for_every_run(logs):
    experiment = tensorboard_experiment(logs)
    differ = [info.name for info in experiment.hparam_infos if info.differs]
    shown = [info.name for info in experiment.hparam_infos[:5]]  # the table's default columns
    assert shown == differ[:5] and {"ReplayCallback.mode", "scale_rewards", "entropy_coef"} <= set(differ)
    assert not {"learning_rate", "loss_type", "_instantiator"} & set(differ)
    assert [m.name.tag for m in experiment.metric_infos][:1] == ["val/pass@1"]
    for run in ("exgrpo-s0", "grpo_baseline-s0"):  # parallel coordinates draws a run with every value
        content = events(logs / run).PluginTagToContent("hparams")["_hparams_/session_start_info"]
        options = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
        assert set(differ) <= set(options), run


@pytest.mark.slow
def test_replay_charts_show_its_effect_on_the_steps_that_replayed(logs):
    exgrpo, grpo = events(logs / "exgrpo-s0"), events(logs / "grpo_baseline-s0")
    share = steps(exgrpo, "train/replayed_share")
    replayed = {step for step, value in share.items() if value > 0}
    assert replayed and all(0 < share[step] < 1 for step in replayed)  # refill: K-1 fresh rows per place
    assert not steps(grpo, "train/replayed_share")  # no replay, no chart
    # Replay-only charts have a point on the steps that replayed and on no other.
    for tag in ("train/is_weight", "replay/staleness"):
        assert set(steps(exgrpo, tag)) == replayed, tag
    before, after = steps(exgrpo, "train/dead_groups_before"), steps(exgrpo, "train/dead_groups_after")
    assert all(after[step] <= before[step] for step in before)
    scalars = set(exgrpo.Tags()["scalars"])
    assert "replay/stored_by_tier_0" in scalars and not any(t.startswith("replay/tier_") for t in scalars)
    assert set(steps(exgrpo, "replay/active").values()) == {1.0}  # the buffer holds min_buffer_size (1)


@pytest.mark.slow
def test_each_run_pictures_its_whole_validation_curve_at_every_validation(logs):
    for run in ("exgrpo-s0", "grpo_baseline-s0"):
        accumulator = events(logs / run)
        validations = sorted(steps(accumulator, "val/pass@1"))
        assert [image.step for image in accumulator.Images("val/pass@1_curve")] == validations, run

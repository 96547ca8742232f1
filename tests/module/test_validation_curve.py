"""The validation curve's picture: every value on its y-axis (where TensorBoard's default scaling leaves the
highest out), one picture per validation of a fit, and a resumed run's curve going on from its
checkpoint's."""

import numpy as np
import pytest
from conftest import tiny_module
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module.validation_curve import (
    CURVE_DPI,
    CURVE_SIZE,
    CURVE_TAG,
    curve_limits,
    draw_curve,
    labelled,
)


def tensorboard_range_before_padding(values: list[float]) -> tuple[float, float]:
    """The y-range TensorBoard 2.21's time-series chart scales to with "Ignore outliers in chart scaling" on
    (its default), before its margin: the sorted values at the 5th and 95th percentile index."""
    ordered = sorted(values)
    last = len(ordered) - 1
    return ordered[int(np.ceil(0.05 * last))], ordered[int(np.floor(0.95 * last))]


def test_a_rising_curve_is_cut_by_tensorboards_scaling_and_whole_in_the_picture():
    rising = [0.331, 0.45, 0.52, 0.57, 0.60, 0.61, 0.637]
    assert tensorboard_range_before_padding(rising)[1] == 0.61  # the final 0.637 is the outlier left out
    low, high = curve_limits(rising)
    assert low < 0.331 and 0.637 < high


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=60))
def test_every_value_lies_inside_the_pictures_range(values):
    low, high = curve_limits(values)
    assert all(low < value < high for value in values)


def test_values_are_written_for_every_point_of_a_short_curve_and_for_first_best_last_of_a_long_one():
    assert labelled([0.1, 0.3, 0.2]) == [0, 1, 2]
    long = [0.1] * 30
    long[7] = 0.9
    assert labelled(long) == [0, 7, 29]


def test_the_picture_is_an_rgb_image_of_its_size():
    image = draw_curve([(0, 0.3), (50, 0.5)], "val/pass@1")
    width, height = (round(inches * CURVE_DPI) for inches in CURVE_SIZE)
    assert image.shape == (height, width, 3) and image.dtype == np.uint8


def _fit(model_dir, root, max_steps, ckpt_path=None):
    seed_everything(0)
    module = tiny_module(model_dir, validate_at_start=True)
    trainer = Trainer(
        accelerator="cpu", max_steps=max_steps, val_check_interval=2, limit_val_batches=1,
        logger=TensorBoardLogger(root, name="", version="run"), enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(64, seed=1), val_fraction=0.25, batch_size=2)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module, trainer


def _events(folder) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    module, _ = _fit(tiny_model_dir, root, max_steps=4)
    return module, _events(root / "run")


def test_a_fit_logs_one_picture_per_validation_of_its_whole_curve(uninterrupted):
    module, events = uninterrupted
    logged = {event.step: event.value for event in events.Scalars("val/pass@1")}
    # Lightning logs a validation after batch n at step n - 1 (val_check_interval 2: steps 1 and 3); the
    # picture's points sit where the chart's do.
    assert [step for step, _ in module.val_curve] == [0, 1, 3] == sorted(logged)
    assert all(value == pytest.approx(logged[step]) for step, value in module.val_curve)
    assert [image.step for image in events.Images(CURVE_TAG)] == [0, 1, 3]


def test_a_resumed_fit_goes_on_with_the_curve_of_its_checkpoint(uninterrupted, tiny_model_dir, tmp_path):
    first, trainer = _fit(tiny_model_dir, tmp_path, max_steps=2)
    checkpoint = tmp_path / "step2.ckpt"
    trainer.save_checkpoint(checkpoint)
    resumed, _ = _fit(tiny_model_dir, tmp_path, max_steps=4, ckpt_path=str(checkpoint))
    assert [step for step, _ in first.val_curve] == [0, 1]
    assert resumed.val_curve == uninterrupted[0].val_curve  # the checkpoint's points, then step 3's
    assert _events(tmp_path / "run").Images(CURVE_TAG)[-1].step == 3

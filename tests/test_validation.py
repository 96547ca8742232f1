"""Every numeric option of the module, the callbacks, the buffer, the bucketer, the sampler, the data and
the tasks is checked when its object is built: NaN, an infinity or a non-number is an error naming it."""

import inspect
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exgrpo_pl.callbacks import DifficultyMonitor, ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule, ReasoningTask
from exgrpo_pl.experience import DifficultyBucketer, SelectiveReplay, TrajectoryBuffer
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import MathVerifyReward
from exgrpo_pl.validation import FLOAT32_MAX, check_number

CLASSES = (
    ExGRPOModule, ReplayCallback, DifficultyMonitor, TrajectoryBuffer, DifficultyBucketer, SelectiveReplay,
    PromptDataModule, ArithmeticTask, ReasoningTask, MathVerifyReward,
)  # fmt: skip
# A parameter annotated as a plain number, optional or not.
NUMERIC = re.compile(r"^(int|float)( \| None)?$")
OPTIONS = [
    (cls, name)
    for cls in CLASSES
    for name, parameter in inspect.signature(cls).parameters.items()
    if NUMERIC.match(str(parameter.annotation))
]


def test_the_numeric_options_are_found():
    names = {f"{cls.__name__}.{name}" for cls, name in OPTIONS}
    expected = {
        "ExGRPOModule.temperature", "ExGRPOModule.learning_rate", "ExGRPOModule.shaping_beta",
        "ReplayCallback.mix_fraction", "SelectiveReplay.gaussian_sigma", "TrajectoryBuffer.max_size",
        "DifficultyBucketer.window_size", "PromptDataModule.val_fraction", "DifficultyMonitor.num_tiers",
    }  # fmt: skip
    assert expected <= names and len(OPTIONS) > 40


@pytest.mark.parametrize("cls, name", OPTIONS, ids=[f"{c.__name__}.{n}" for c, n in OPTIONS])
@given(bad=st.sampled_from([math.nan, math.inf, -math.inf, "1", True]))
def test_a_non_finite_or_non_numeric_option_is_an_error_naming_it(cls, name, bad):
    with pytest.raises(ValueError, match=rf"^{cls.__name__} {name}=.*: must be"):
        cls(**{name: bad})


@pytest.mark.parametrize("bad", [1e39, -1e39, 10**40])
def test_a_number_beyond_float32_is_an_error(bad):
    with pytest.raises(ValueError, match=r"^Owner option=.*: must be finite in float32"):
        check_number("Owner", "option", bad)


@pytest.mark.parametrize(
    "weights, message",
    [
        ([math.nan], r"reward_weights\[0\]=nan: must be finite"),
        ([1.0, 1e39], r"reward_weights\[1\]=1e\+39: must be finite in float32"),
        (["1"], r"reward_weights\[0\]='1': must be a number"),
        ([0.0, 0], r"reward_weights=\[0.0, 0\]: at least one must be non-zero"),
    ],
)
def test_reward_weights_are_each_checked_at_construction(weights, message):
    with pytest.raises(ValueError, match=rf"^ExGRPOModule {message}"):
        ExGRPOModule(reward_weights=weights)


def test_a_learning_rate_above_one_is_an_error():
    with pytest.raises(ValueError, match=r"^ExGRPOModule learning_rate=1e\+38: must be in \(0, 1\]"):
        ExGRPOModule(learning_rate=1e38)


@given(percentile=st.sampled_from([math.nan, math.inf, 101.0, -1.0]))
def test_entropy_percentiles_are_each_checked(percentile):
    with pytest.raises(ValueError, match="TrajectoryBuffer entropy_percentiles="):
        TrajectoryBuffer(entropy_percentiles=(25, percentile))


@given(
    value=st.floats(allow_nan=True, allow_infinity=True),
    low=st.one_of(st.none(), st.floats(-10, 10)),
    high=st.one_of(st.none(), st.floats(-10, 10)),
    low_open=st.booleans(),
    high_open=st.booleans(),
)
def test_check_number_accepts_exactly_the_finite_values_in_range(value, low, high, low_open, high_open):
    inside = math.isfinite(value) and abs(value) <= FLOAT32_MAX
    if low is not None:
        inside &= value > low if low_open else value >= low
    if high is not None:
        inside &= value < high if high_open else value <= high
    rule = dict(low=low, high=high, low_open=low_open, high_open=high_open)
    if inside:
        assert check_number("Owner", "option", value, **rule) == value
    else:
        with pytest.raises(ValueError, match=r"^Owner option="):
            check_number("Owner", "option", value, **rule)


def test_integers_and_none_where_allowed():
    assert check_number("Owner", "n", None, 1, integer=True, optional=True) is None
    with pytest.raises(ValueError, match="Owner n=2.5: must be an integer"):
        check_number("Owner", "n", 2.5, 1, integer=True)
    with pytest.raises(ValueError, match="Owner n=None: must be a number"):
        check_number("Owner", "n", None, 1)

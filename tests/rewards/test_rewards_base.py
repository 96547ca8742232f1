"""Tests for the reward-function protocol: weights, None handling, names, return-value checks, time limit."""

import contextvars
import math
import pickle
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from exgrpo_pl.rewards import (
    ArithmeticReward,
    FormatReward,
    RewardFunction,
    RewardTimeoutError,
    compute_rewards,
)
from exgrpo_pl.rewards.base import reward_name


def always_one(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def only_math(prompts, completions, domain, **kwargs):
    return [1.0 if d == "math" else None for d in domain]


def never(prompts, completions, **kwargs):
    return [None] * len(completions)


PROMPTS = ["1+1=", "2+2=", "3+3="]
COMPLETIONS = ["2", "5", "6"]
COLUMNS = {"answer": ["2", "4", "6"], "domain": ["math", "code", "math"]}


def test_default_weights_sum_functions():
    total, per = compute_rewards([ArithmeticReward(), always_one], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert total.tolist() == [2.0, 1.0, 2.0]
    assert set(per) == {"arithmetic", "always_one"}
    assert per["arithmetic"].dtype == torch.float32


def test_weights_scale_each_function():
    total, _ = compute_rewards([ArithmeticReward(), always_one], [2.0, 0.5], PROMPTS, COMPLETIONS, COLUMNS)
    assert total.tolist() == [2.5, 0.5, 2.5]


def test_none_is_nan_and_left_out_of_the_sum():
    total, per = compute_rewards([only_math, always_one], [3.0, 1.0], PROMPTS, COMPLETIONS, COLUMNS)
    assert math.isnan(per["only_math"][1].item())
    assert total.tolist() == [4.0, 1.0, 4.0]


def test_all_none_row_totals_zero_with_a_warning():
    with pytest.warns(UserWarning, match="every reward function returned None"):
        total, per = compute_rewards([never], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert total.tolist() == [0.0, 0.0, 0.0]
    assert per["never"].isnan().all()


def test_no_warning_when_some_function_applies():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute_rewards([never, always_one], None, PROMPTS, COMPLETIONS, COLUMNS)


def test_weights_length_mismatch():
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        compute_rewards([always_one], [1.0, 2.0], PROMPTS, COMPLETIONS, COLUMNS)


def test_wrong_length_result_names_the_function():
    def short(prompts, completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="'short' returned 1 scores for 3"):
        compute_rewards([short], None, PROMPTS, COMPLETIONS, COLUMNS)


def test_column_length_mismatch():
    with pytest.raises(ValueError, match="column 'answer'"):
        compute_rewards([always_one], None, PROMPTS, COMPLETIONS, {"answer": ["1"]})


def test_duplicate_names_rejected():
    with pytest.raises(ValueError, match="named 'format'"):
        compute_rewards([FormatReward("a"), FormatReward("b")], None, PROMPTS, COMPLETIONS, COLUMNS)


def test_columns_arrive_as_keywords():
    seen = {}

    def spy(prompts, completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(prompts)

    compute_rewards([spy], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert seen == COLUMNS


def test_reward_name():
    class Plain:
        def __call__(self, prompts, completions, **kw):
            return []

    assert reward_name(always_one) == "always_one"
    assert reward_name(Plain()) == "Plain"
    assert reward_name(ArithmeticReward(name="calc")) == "calc"
    assert isinstance(ArithmeticReward(), RewardFunction)


def test_empty_batch():
    total, per = compute_rewards([always_one], None, [], [], {})
    assert total.shape == (0,) and per["always_one"].shape == (0,)


# --- what a reward function returns ---


def returning(value, name="scorer"):
    """A reward function that returns `value` whatever it is given."""

    def fn(prompts, completions, **kwargs):
        return value

    fn.__name__ = name
    return fn


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e39, -(10**400)])
def test_non_finite_score_names_function_row_and_completion(bad):
    # 1e39 is finite in Python but inf in float32, where the rewards are kept; 10**400 is an int beyond float.
    with pytest.raises(
        ValueError, match=r"'scorer' returned .* for row 1 \(completion '5'\); .* finite number"
    ):
        compute_rewards([returning([1.0, bad, 0.0])], None, PROMPTS, COMPLETIONS, COLUMNS)


def test_nan_is_an_error_not_a_none():
    # NaN used to slip through the nansum as if the function had returned None.
    with pytest.raises(ValueError, match=r"returned nan for row 0"):
        compute_rewards([returning([math.nan, None, 1.0]), always_one], None, PROMPTS, COMPLETIONS, COLUMNS)


@pytest.mark.parametrize(
    ("value", "got"),
    [
        (0.5, r"float 0\.5"),
        ("110", r"str '110'"),
        ({"a": 1.0, "b": 1.0, "c": 1.0}, r"dict \{'a': 1\.0"),
        ({1.0, 2.0, 3.0}, r"set"),
        (torch.ones(3, 1), r"Tensor of shape \(3, 1\)"),
        (torch.ones(2), r"Tensor of shape \(2,\)"),
        (np.array(["1", "0", "1"]), r"ndarray of shape \(3,\) and dtype <U1"),
        (torch.ones(3, dtype=torch.complex64), r"Tensor of shape \(3,\) and dtype torch\.complex64"),
    ],
)
def test_wrong_return_type_names_function_expected_type_and_value(value, got):
    with pytest.raises((TypeError, ValueError)) as info:
        compute_rewards([returning(value)], None, PROMPTS, COMPLETIONS, COLUMNS)
    message = str(info.value)
    assert "reward function 'scorer' returned" in message
    assert "expected list[float | None] of length 3" in message
    assert info.match(got)


@pytest.mark.parametrize("entry", ["0.5", [1.0], 1 + 2j, {"score": 1.0}, torch.ones(1)])
def test_non_numeric_score_names_function_and_row(entry):
    with pytest.raises(TypeError, match=r"'scorer' returned .* for row 2 \(completion '6'\); expected list"):
        compute_rewards([returning([1.0, 0.0, entry])], None, PROMPTS, COMPLETIONS, COLUMNS)


@pytest.mark.parametrize(
    "value",
    [
        (1.0, 0, True),
        [np.float32(1.0), np.int64(0), np.bool_(True)],
        [torch.tensor(1.0), torch.tensor(0), torch.tensor(True)],
        np.array([1.0, 0.0, 1.0]),
        np.array([1, 0, 1]),
        torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64, requires_grad=True),
        torch.tensor([True, False, True]),
    ],
    ids=["tuple", "numpy-scalars", "torch-scalars", "float-array", "int-array", "tensor", "bool-tensor"],
)
def test_numpy_and_torch_returns_are_accepted(value):
    total, per = compute_rewards([returning(value)], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert total.tolist() == [1.0, 0.0, 1.0]
    assert per["scorer"].dtype == torch.float32 and not per["scorer"].requires_grad


def test_object_array_with_none_is_read_entry_by_entry():
    _, per = compute_rewards(
        [returning(np.array([1.0, None, 0.0])), always_one], None, PROMPTS, COMPLETIONS, COLUMNS
    )
    assert per["scorer"][0] == 1.0 and per["scorer"][1].isnan() and per["scorer"][2] == 0.0


def test_non_finite_weight_rejected():
    with pytest.raises(ValueError, match="reward weights must be finite"):
        compute_rewards([always_one], [math.inf], PROMPTS, COMPLETIONS, COLUMNS)


def test_class_reward_is_named_by_its_name_attribute():
    class Judge:
        name = "judge"

        def __call__(self, prompts, completions, **kwargs):
            return [1.0, math.inf, 0.0]

    with pytest.raises(ValueError, match="reward function 'judge' returned inf for row 1"):
        compute_rewards([Judge()], None, PROMPTS, COMPLETIONS, COLUMNS)


# --- the time limit ---


@pytest.fixture
def stuck():
    """A reward function that blocks until the test ends (then returns), and the event it waits on."""
    release = threading.Event()

    def stuck(prompts, completions, **kwargs):
        release.wait(30)
        return [0.0] * len(completions)

    yield stuck
    release.set()


def test_timeout_raises_naming_function_completions_and_limit(stuck):
    started = time.perf_counter()
    with pytest.raises(
        RewardTimeoutError, match=r"'stuck' did not return within 0\.2 s scoring 3 completions"
    ) as info:
        compute_rewards([always_one, stuck], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=0.2)
    assert time.perf_counter() - started < 5.0
    assert isinstance(info.value, TimeoutError)
    assert "raise the limit" in str(info.value) and "reward_timeout_seconds" in str(info.value)
    assert (info.value.name, info.value.num_completions, info.value.timeout_seconds) == ("stuck", 3, 0.2)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.name == "stuck"


def test_timeout_holds_outside_the_main_thread(stuck):
    caught = []

    def step():
        try:
            compute_rewards([stuck], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=0.2)
        except RewardTimeoutError as err:
            caught.append(err)

    worker = threading.Thread(target=step)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and len(caught) == 1


def test_an_abandoned_call_does_not_keep_the_process_alive():
    script = (
        "import time\n"
        "from exgrpo_pl.rewards import RewardTimeoutError, compute_rewards\n"
        "def sleepy(prompts, completions, **kw):\n"
        "    time.sleep(60)\n"
        "try:\n"
        "    compute_rewards([sleepy], None, ['p'], ['c'], {}, timeout_seconds=0.1)\n"
        "except RewardTimeoutError:\n"
        "    print('timed out')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "timed out"


def test_a_limited_call_returns_its_scores_and_raises_its_errors():
    total, _ = compute_rewards([ArithmeticReward()], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    assert total.tolist() == [1.0, 0.0, 1.0]

    def broken(prompts, completions, **kwargs):
        raise KeyError("no such column")

    with pytest.raises(KeyError, match="no such column"):
        compute_rewards([broken], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    with pytest.raises(ValueError, match="'scorer' returned nan"):
        compute_rewards([returning([math.nan] * 3)], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)


def test_a_limited_call_sees_the_callers_grad_mode_and_context():
    variable = contextvars.ContextVar("variable", default="unset")
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append((torch.is_grad_enabled(), variable.get()))
        return [0.0] * len(completions)

    variable.set("caller's")
    with torch.no_grad():
        compute_rewards([spy], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    compute_rewards([spy], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    assert seen == [(False, "caller's"), (True, "caller's")]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_limited_call_sees_the_callers_cuda_device():
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append(torch.cuda.current_device())
        return [0.0] * len(completions)

    torch.cuda.set_device(1)
    try:
        compute_rewards([spy], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    finally:
        torch.cuda.set_device(0)
    assert seen == [1]


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True])
def test_bad_timeout_rejected(bad):
    with pytest.raises(ValueError, match="timeout_seconds must be a positive number or None"):
        compute_rewards([always_one], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=bad)

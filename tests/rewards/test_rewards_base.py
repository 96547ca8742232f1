"""Tests for the reward-function protocol: weights, None handling, names and length checks."""

import math
import warnings

import pytest
import torch

from exgrpo_pl.rewards import ArithmeticReward, FormatReward, RewardFunction, compute_rewards
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

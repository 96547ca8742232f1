"""Reward functions (verifiers) and the TRL-compatible protocol they follow. Core package: no Lightning.

Layer: just above the shared basics (`exgrpo_pl.validation`), the only other part it imports; the prompt data
(`exgrpo_pl.data`) and the training step (`exgrpo_pl.step.collect` scores rollouts with it) sit above it.
"""

from exgrpo_pl.rewards.arithmetic import ArithmeticReward
from exgrpo_pl.rewards.base import (
    AnswerReward,
    RewardFunction,
    check_rewards,
    completion_text,
    compute_rewards,
    reward_name,
)
from exgrpo_pl.rewards.by_source import AsyncRewardBySource, RewardBySource
from exgrpo_pl.rewards.exact_match import ExactMatchReward
from exgrpo_pl.rewards.format import FormatReward
from exgrpo_pl.rewards.limit import RewardNotSendableError, RewardTimeoutError
from exgrpo_pl.rewards.math_verify import MathVerifyReward, extract_boxed
from exgrpo_pl.rewards.multiple_choice import MultipleChoiceReward, option_label
from exgrpo_pl.rewards.protocol import REWARD_KEYWORDS, RewardLog
from exgrpo_pl.rewards.reasoning import ReasoningReward

__all__ = [
    "REWARD_KEYWORDS",
    "AnswerReward",
    "ArithmeticReward",
    "AsyncRewardBySource",
    "ExactMatchReward",
    "FormatReward",
    "MathVerifyReward",
    "MultipleChoiceReward",
    "ReasoningReward",
    "RewardBySource",
    "RewardFunction",
    "RewardLog",
    "RewardNotSendableError",
    "RewardTimeoutError",
    "check_rewards",
    "completion_text",
    "compute_rewards",
    "extract_boxed",
    "option_label",
    "reward_name",
]

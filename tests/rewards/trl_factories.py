"""TRL's configured reward functions, built by its factories, for the tests to name by import path (as a
user's config names them): `--model.reward_funcs=[trl_factories.overlong, ...]`."""

from trl.rewards import get_cosine_scaled_reward, get_repetition_penalty_reward, get_soft_overlong_punishment

# The tests' completions are at most 4 tokens: limits that short make every branch of each function score.
overlong = get_soft_overlong_punishment(max_completion_len=3, soft_punish_cache=2)
repetition = get_repetition_penalty_reward(ngram_size=1, max_penalty=-1.0)
cosine = get_cosine_scaled_reward(max_len=4)

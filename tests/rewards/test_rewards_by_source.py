"""Tests for RewardBySource: rows routed by their source, one call per reward function with its own rows and
columns, TRL's None semantics, errors naming the source, and the time limit's worker process."""

import math
import os
import pickle

import pytest

from exgrpo_pl.rewards import compute_rewards, limit
from exgrpo_pl.rewards.by_source import AsyncRewardBySource, RewardBySource, extract_answer
from exgrpo_pl.rewards.multiple_choice import MultipleChoiceReward
from exgrpo_pl.rewards.protocol import is_async

# Run in the worker process, these are pickled by reference: module-level, importable by this module's name.


def process_id(prompts, completions, **columns):
    """Not `in_process`: under a time limit it runs in the worker, and scores each row with its pid."""
    return [float(os.getpid())] * len(completions)


def half(prompts, completions, **columns):
    return [0.5] * len(completions)


half.in_process = True


class Recorder:
    """Scores row i with `scores[i % len(scores)]` and records what each call got."""

    in_process = True

    def __init__(self, name, scores=(1.0,)):
        self.name = name
        self.scores = scores
        self.calls = []

    def __call__(self, prompts, completions, **columns):
        self.calls.append({"prompts": prompts, "completions": completions, **columns})
        return [self.scores[i % len(self.scores)] for i in range(len(completions))]


PROMPTS = ["p0", "p1", "p2", "p3", "p4"]
COMPLETIONS = ["c0", "c1", "c2", "c3", "c4"]
COLUMNS = {"domain": ["math", "gpqa", "math", "arc_c", "gpqa"], "answer": ["a0", "a1", "a2", "a3", "a4"]}


def test_each_function_is_called_once_with_its_own_rows_and_columns():
    math_fn, choice_fn = Recorder("m", (1.0, 0.0)), Recorder("c", (0.25,))
    router = RewardBySource({"math": math_fn, "gpqa": choice_fn, "arc_c": choice_fn})
    scores = router(PROMPTS, COMPLETIONS, **COLUMNS)
    assert scores == [1.0, 0.25, 0.0, 0.25, 0.25]
    assert math_fn.calls == [
        {
            "prompts": ["p0", "p2"],
            "completions": ["c0", "c2"],
            "domain": ["math", "math"],
            "answer": ["a0", "a2"],
        }
    ]
    # Two sources, one function: one call, their rows in row order.
    assert choice_fn.calls == [
        {
            "prompts": ["p1", "p3", "p4"],
            "completions": ["c1", "c3", "c4"],
            "domain": ["gpqa", "arc_c", "gpqa"],
            "answer": ["a1", "a3", "a4"],
        }
    ]


def test_keyword_arguments_that_are_not_columns_pass_whole():
    recorder = Recorder("r")
    state, words = object(), ["stop", "halt"]  # like TRL's trainer_state; a list, but not one value per row
    router = RewardBySource({"math": recorder}, default=recorder)
    router(PROMPTS, COMPLETIONS, trainer_state=state, stop_words=words, **COLUMNS)
    assert recorder.calls[0]["trainer_state"] is state and recorder.calls[0]["stop_words"] is words


def test_the_default_scores_the_sources_not_named():
    named, default = Recorder("named", (1.0,)), Recorder("default", (0.0,))
    scores = RewardBySource({"gpqa": named}, default=default)(PROMPTS, COMPLETIONS, **COLUMNS)
    assert scores == [0.0, 1.0, 0.0, 0.0, 1.0]
    assert default.calls[0]["domain"] == ["math", "math", "arc_c"]


def test_a_source_without_a_function_or_default_is_an_error_naming_it():
    router = RewardBySource({"math": Recorder("m")}, name="router")
    with pytest.raises(
        ValueError,
        match=r"'router' has no reward function for source 'gpqa' \(rows \[1, 4\]\), 'arc_c' \(rows \[3\]\), "
        r"and no default; its sources: \['math'\]",
    ):
        router(PROMPTS, COMPLETIONS, **COLUMNS)


def test_none_scores_stay_none_and_drop_out_of_the_sum():
    rewards = {"math": Recorder("m", (None, 1.0)), "gpqa": Recorder("g", (0.5,)), "arc_c": None}
    router = RewardBySource(rewards)
    assert router(PROMPTS, COMPLETIONS, **COLUMNS) == [None, 0.5, 1.0, None, 0.5]
    with pytest.warns(UserWarning, match="every reward function returned None for some rows"):
        total, per_function = compute_rewards([router], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert [math.isnan(x) for x in per_function["by_source"].tolist()] == [True, False, False, True, False]
    assert total.tolist() == [0.0, 0.5, 1.0, 0.0, 0.5]


def test_it_routes_by_another_column_and_needs_it():
    router = RewardBySource({"a0": Recorder("x", (1.0,))}, default=Recorder("y", (0.0,)), column="answer")
    assert router(PROMPTS, COMPLETIONS, **COLUMNS) == [1.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"routes rows by the 'answer' column, which the batch lacks"):
        router(PROMPTS, COMPLETIONS, domain=COLUMNS["domain"])


def test_a_function_returning_the_wrong_number_of_scores_is_named():
    def short(prompts, completions, **columns):
        return [1.0]

    with pytest.raises(ValueError, match=r"'short' \(of 'by_source', sources \['gpqa'\]\) returned 1 scores"):
        RewardBySource({"gpqa": short}, default=Recorder("r"))(PROMPTS, COMPLETIONS, **COLUMNS)


def test_construction_errors():
    with pytest.raises(TypeError, match="the reward function of 'math' is not callable"):
        RewardBySource({"math": 1.0})
    with pytest.raises(ValueError, match="needs at least one reward function"):
        RewardBySource({"math": None})


def test_it_is_in_process_when_every_function_it_routes_to_is():
    assert RewardBySource({"math": half, "gpqa": MultipleChoiceReward(), "arc_c": None}).in_process
    assert not RewardBySource({"math": half}, default=process_id).in_process


def test_conversational_rows_reach_the_multiple_choice_reward():
    router = RewardBySource({"gpqa": MultipleChoiceReward()}, default=half)
    completions = [[{"role": "assistant", "content": f"\\boxed{{{letter}}}"}] for letter in "ABCDA"]
    answers = ["x", "B", "x", "x", "B"]
    scores = router(PROMPTS, completions, domain=COLUMNS["domain"], answer=answers)
    assert scores == [0.5, 1.0, 0.5, 0.5, 0.0]


def test_an_in_process_router_runs_here_under_a_time_limit(monkeypatch):
    monkeypatch.setattr(limit, "_worker", None)
    router = RewardBySource({"gpqa": MultipleChoiceReward()}, default=half)
    answers = {"domain": COLUMNS["domain"], "answer": ["x", "A", "x", "x", "B"]}
    completions = ["c", "\\boxed{A}", "c", "c", "\\boxed{C}"]
    total, _ = compute_rewards([router], None, PROMPTS, completions, answers, timeout_seconds=5)
    assert total.tolist() == [0.5, 1.0, 0.5, 0.5, 0.0] and limit._worker is None


def test_a_router_with_a_limited_function_runs_in_the_worker_process():
    router = RewardBySource({"gpqa": MultipleChoiceReward()}, default=process_id)
    assert pickle.loads(pickle.dumps(router)).rewards.keys() == {"gpqa"}
    columns = {"domain": COLUMNS["domain"], "answer": ["x", "A", "x", "x", "B"]}
    completions = ["c", "\\boxed{A}", "c", "c", "\\boxed{C}"]
    # The first call imports this module and torch in the worker: seconds, outside the limit under test.
    compute_rewards([router], None, PROMPTS, completions, columns, timeout_seconds=120)
    total, _ = compute_rewards([router], None, PROMPTS, completions, columns, timeout_seconds=5)
    worker = limit._worker.process.pid
    assert worker != os.getpid()
    assert total.tolist() == [worker, 1.0, worker, worker, 0.0]


def test_an_integer_source_key_routes_integer_and_text_sources():
    # A YAML key `7:` is the int 7; the data module reads a data_source of 7 as "7".
    seven, other = Recorder("seven", (1.0,)), Recorder("other", (0.0,))
    router = RewardBySource({7: seven}, default=other)
    assert router(["p0", "p1", "p2"], ["c0", "c1", "c2"], domain=["7", 7, "8"]) == [1.0, 1.0, 0.0]
    assert seven.calls[0]["domain"] == ["7", 7]


def test_two_keys_that_are_one_source_are_an_error():
    with pytest.raises(ValueError, match="sources 7 and '7' are the same source"):
        RewardBySource({"7": half, 7: half})


class Reads:
    """Extracts what follows `prefix` in a completion."""

    in_process = True

    def __init__(self, prefix):
        self.prefix = prefix

    def __call__(self, prompts, completions, **columns):
        return [1.0] * len(completions)

    def extract_answer(self, completion):
        return completion.split(self.prefix)[1] if self.prefix in completion else None


def test_answers_are_read_by_the_function_of_each_rows_source():
    router = RewardBySource({"gpqa": MultipleChoiceReward(), "math": Reads("= "), "none": None}, default=half)
    assert router.extract_answer("so \\boxed{c}", domain="gpqa") == "C"
    assert router.extract_answer("x = 42", domain="math", answer="42") == "42"
    assert router.extract_answer("x = 42", domain="none") is None  # not scored
    assert router.extract_answer("x = 42", domain="other") is None  # the default extracts nothing
    # The same helper the evaluation uses: the row's columns reach an extract_answer that takes them.
    assert extract_answer(router, "\\boxed{B}", {"domain": "gpqa"}) == "B"
    assert extract_answer(Reads(": "), "a: b", {"domain": "x"}) == "b"
    assert extract_answer(half, "a: b", {}) is None


def test_reading_an_answer_needs_the_routing_column_and_a_function():
    router = RewardBySource({"math": Reads("= ")})
    with pytest.raises(ValueError, match="by the 'domain' column, which the row lacks"):
        router.extract_answer("x = 1", answer="1")
    with pytest.raises(ValueError, match="no reward function for source 'gpqa'"):
        router.extract_answer("x = 1", domain="gpqa")


async def async_half(prompts, completions, **columns):
    return [0.5] * len(completions)


def test_an_async_function_among_the_sources_is_awaited_with_the_steps_other_async_rewards():
    """Before, the router called an `async def` function and failed on the coroutine it got back."""
    router = RewardBySource({"gpqa": MultipleChoiceReward()}, default=async_half)
    assert isinstance(router, AsyncRewardBySource) and is_async(router)
    assert not is_async(RewardBySource({"gpqa": MultipleChoiceReward()}, default=half))
    columns = {"domain": COLUMNS["domain"], "answer": ["x", "A", "x", "x", "B"]}
    completions = ["c", "\\boxed{A}", "c", "c", "\\boxed{C}"]
    total, _ = compute_rewards([router], None, PROMPTS, completions, columns)
    assert total.tolist() == [0.5, 1.0, 0.5, 0.5, 0.0]
    assert pickle.loads(pickle.dumps(router)).rewards.keys() == {"gpqa"}  # it travels to the worker

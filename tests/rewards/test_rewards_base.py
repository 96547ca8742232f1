"""Tests for the reward-function protocol: weights, None handling, names, return-value checks, time limit."""

import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import is_gone
from worker_rewards import (
    async_blocks_its_loop,
    async_forever,
    async_ones,
    async_raises,
    async_wait,
    async_wait_too,
    backtracking,
    missing_column,
    nan_scores,
    ones,
    state_and_ids,
)

from exgrpo_pl.experience import DifficultyBucketer
from exgrpo_pl.rewards import (
    ArithmeticReward,
    ExactMatchReward,
    FormatReward,
    ReasoningReward,
    RewardFunction,
    RewardLog,
    RewardNotSendableError,
    RewardTimeoutError,
    check_rewards,
    compute_rewards,
    limit,
)
from exgrpo_pl.rewards.base import reward_name
from exgrpo_pl.rewards.worker import Terminated


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


def test_none_is_trls_none_row_by_row_and_a_row_none_applies_to_is_an_incorrect_zero():
    """TRL's GRPOTrainer: a None is NaN in its function's column, a row's reward the nansum over functions of
    weight x score, in float32. A row no function scores is 0 here, hence incorrect, and the bucketer
    counts it as a failed attempt; TRL 1.16 (since huggingface/trl#5902) makes it NaN, leaves it out of its
    group's mean and std and gives it advantage 0 (docs/how-it-works.md, "Rewards")."""
    scores = {"f": [0.25, None, None, 1.0], "g": [None, 0.5, None, 0.75]}
    funcs = [returning(scores[name], name) for name in scores]
    with pytest.warns(UserWarning, match="every reward function returned None"):
        total, per = compute_rewards(funcs, [2.0, 0.5], PROMPTS + ["4+4="], COMPLETIONS + ["8"], {})
    trl_per_func = torch.tensor(
        [[torch.nan if s is None else s for s in column] for column in scores.values()], dtype=torch.float32
    ).T  # [N, F], as _calculate_rewards fills it
    torch.testing.assert_close(torch.stack([per["f"], per["g"]], dim=1), trl_per_func, equal_nan=True)
    trl_total = (trl_per_func * torch.tensor([2.0, 0.5])).nansum(dim=1)
    assert torch.equal(total, trl_total) and total.tolist() == [0.5, 0.25, 0.0, 2.375]
    assert trl_per_func.isnan().all(dim=1).tolist() == [False, False, True, False]  # TRL's unscorable rows
    bucketer = DifficultyBucketer()
    bucketer.update(torch.tensor([7, 7]), torch.tensor([1.0, total[2].item()]))
    assert [c.tolist() for c in bucketer.latest_counts(torch.tensor([7]))] == [[1], [2]]


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
    assert set(seen) == {*COLUMNS, "log_extra", "log_metric"}  # ids and state only when given
    assert {key: seen[key] for key in COLUMNS} == COLUMNS


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


def worker_pid():
    return limit._worker.process.pid


def test_a_limited_call_runs_in_the_worker_and_returns_its_scores():
    total, _ = compute_rewards([ones], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    assert total.tolist() == [1.0, 1.0, 1.0] and worker_pid() != os.getpid()


def test_the_limit_holds_for_a_reward_that_keeps_the_gil_and_kills_it():
    compute_rewards([ones], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)  # the worker is up
    pid = worker_pid()
    started = time.perf_counter()
    with pytest.raises(
        RewardTimeoutError, match=r"'backtracking' did not return within 0\.5 s scoring 3 completions"
    ) as info:
        compute_rewards([ones, backtracking], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=0.5)
    assert time.perf_counter() - started < 3.0
    assert is_gone(pid)  # killed, not abandoned
    assert "raise the limit" in str(info.value) and "reward_timeout_seconds" in str(info.value)
    assert (info.value.name, info.value.num_completions) == ("backtracking", 3)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.name == "backtracking"
    total, _ = compute_rewards([ones], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    assert total.tolist() == [1.0, 1.0, 1.0]  # a new worker


def test_the_limit_holds_outside_the_main_thread():
    caught = []

    def step():
        try:
            compute_rewards([backtracking], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=0.5)
        except RewardTimeoutError as err:
            caught.append(err)

    thread = threading.Thread(target=step)
    thread.start()
    thread.join(20)
    assert not thread.is_alive() and len(caught) == 1


@pytest.fixture
def python_ctrl_c_handler():
    """Python's own Ctrl-C handler, which a process started with SIGINT ignored (`nohup ... &`) lacks: there
    the signal would never arrive and the test would wait out the reward's 600 s."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "signum, error", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)], ids=["TERM", "INT"]
)
def test_sigterm_and_ctrl_c_end_the_wait_and_kill_the_worker(signum, error, python_ctrl_c_handler):
    compute_rewards([ones], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)  # the worker is up
    pid, handler = worker_pid(), signal.getsignal(signal.SIGTERM)
    sender = threading.Timer(0.5, os.kill, (os.getpid(), signum))
    sender.start()
    started = time.perf_counter()
    with pytest.raises(error):
        compute_rewards([backtracking], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=600)
    sender.join()
    assert time.perf_counter() - started < 5.0 and is_gone(pid)
    assert signal.getsignal(signal.SIGTERM) is handler  # put back after the wait


def test_sigterm_runs_the_installed_handler_first():
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(Terminated):
            compute_rewards([backtracking], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=600)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]  # e.g. Lightning's, which marks the trainer as terminated


def test_a_limited_call_raises_its_errors_with_the_workers_traceback():
    with pytest.raises(KeyError, match="no_such_column") as info:
        compute_rewards([missing_column], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    assert "in missing_column" in str(info.value.__cause__)
    with pytest.raises(ValueError, match="'nan_scores' returned nan"):
        compute_rewards([nan_scores], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)


def test_a_local_function_runs_in_the_worker_by_value():
    here = os.getpid()
    local = lambda prompts, completions, **columns: [float(os.getpid() != here)] * 3  # noqa: E731
    total, _ = compute_rewards([local], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    assert total.tolist() == [1.0, 1.0, 1.0]  # it ran in another process


def test_a_reward_that_cannot_reach_the_worker_is_a_clear_error(monkeypatch):
    lock = threading.Lock()

    def locked(prompts, completions, **columns):
        with lock:
            return [1.0] * len(completions)

    with pytest.raises(RewardNotSendableError, match=r"'locked' cannot run in a worker.*lock.*in_process"):
        compute_rewards([locked], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    # Picklable here, but its module exists only in this process (as a script's `__main__` would).
    ghost = types.ModuleType("ghost_module")
    exec("def ghostly(prompts, completions, **columns):\n    return [1.0] * len(completions)", ghost.__dict__)
    monkeypatch.setitem(sys.modules, "ghost_module", ghost)
    with pytest.raises(RewardNotSendableError, match=r"'ghostly'.*No module named 'ghost_module'"):
        compute_rewards([ghost.ghostly], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)


def test_in_process_functions_are_called_here_without_a_worker(monkeypatch):
    monkeypatch.setattr(limit, "_worker", None)
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append(threading.current_thread() is threading.main_thread())
        return [0.0] * len(completions)

    spy.in_process = True
    shipped = [ArithmeticReward(), ExactMatchReward(), ReasoningReward()]
    compute_rewards([spy, *shipped], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)
    assert seen == [True] and limit._worker is None


@pytest.mark.slow
def test_a_worker_stuck_in_c_dies_with_a_killed_trainer(tmp_path):
    script = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from exgrpo_pl.rewards import compute_rewards, limit\n"
        "from worker_rewards import backtracking, ones\n"
        "compute_rewards([ones], None, ['p'], ['c'], {}, timeout_seconds=600)\n"
        "print(limit._worker.process.pid, flush=True)\n"
        "compute_rewards([backtracking], None, ['p'], ['c'], {}, timeout_seconds=600)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(trainer.stdout.readline())
    time.sleep(0.5)
    trainer.kill()
    trainer.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not is_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert is_gone(pid)


@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True])
def test_bad_timeout_rejected(bad):
    with pytest.raises(ValueError, match="timeout_seconds must be a positive number or None"):
        compute_rewards([always_one], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=bad)


def test_a_column_named_like_an_argument_from_the_trainer_is_an_error():
    def count(prompts, completions, **columns):
        return [float(c == "13") for c in completions]

    with pytest.raises(ValueError, match="column 'completions' has the name of an argument reward functions"):
        compute_rewards([count], None, ["10+3="], ["4"], {"completions": ["13"]})


# ---------------------------------------------------------------------------- TRL's whole protocol
IDS = [[5, 6], [7], [8, 9, 10]]
STATE = types.SimpleNamespace(global_step=4, epoch=1.5, max_steps=8)


@pytest.mark.parametrize("timeout", [None, 30], ids=["here", "worker"])
def test_completion_ids_trainer_state_and_logs_reach_a_function_here_and_in_the_worker(timeout):
    log = RewardLog()
    _, per_function = compute_rewards(
        [state_and_ids], None, PROMPTS, COMPLETIONS, COLUMNS, timeout,
        completion_ids=IDS, trainer_state=STATE, log=log,
    )  # fmt: skip
    assert per_function["state_and_ids"].tolist() == [6.0, 5.0, 7.0]  # global_step + len(ids)
    assert log.extra == {"n_ids": [2, 1, 3]}  # logged in the worker, back here


@pytest.mark.parametrize("timeout", [None, 30], ids=["here", "worker"])
def test_async_functions_are_awaited_concurrently_with_their_logs(timeout):
    compute_rewards([ones], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)  # the worker is up
    log = RewardLog()
    started = time.perf_counter()
    total, per_function = compute_rewards(
        [async_wait, ones, async_wait_too], None, PROMPTS, COMPLETIONS, COLUMNS, timeout, log=log
    )
    took = time.perf_counter() - started
    assert 1.0 <= took < 1.9  # two 1 s sleeps together, not one after the other
    assert list(per_function) == ["async_wait", "ones", "async_wait_too"]  # the functions' order
    assert total.tolist() == [6.0, 6.0, 6.0] and log.means() == {"judge_calls": 3.0}


def test_an_async_function_past_the_limit_is_named_and_cancelled():
    started = time.perf_counter()
    with pytest.raises(RewardTimeoutError, match=r"'async_forever' did not return within 0\.5 s"):
        compute_rewards([async_ones, async_forever], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=0.5)
    assert time.perf_counter() - started < 3.0


def test_an_async_function_that_blocks_its_loop_is_stopped_by_the_hard_limit():
    compute_rewards([ones], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)  # the worker is up
    pid = worker_pid()
    with pytest.raises(RewardTimeoutError, match=r"'async_blocks_its_loop / async_wait' did not return"):
        funcs = [async_blocks_its_loop, async_wait]
        compute_rewards(funcs, None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=0.5)
    assert is_gone(pid)


@pytest.mark.parametrize("timeout", [None, 30], ids=["here", "worker"])
def test_an_async_functions_error_is_raised_with_its_traceback(timeout):
    with pytest.raises(LookupError, match="the judge is down") as info:
        compute_rewards([async_wait, async_raises], None, PROMPTS, COMPLETIONS, COLUMNS, timeout)
    assert "in async_raises" in str(info.value.__cause__)


def test_an_async_functions_scores_are_checked_as_any_others():
    async def bad(prompts, completions, **columns):
        return [math.nan] * len(completions)

    with pytest.raises(ValueError, match="'bad' returned nan for row 0"):
        compute_rewards([bad], None, PROMPTS, COMPLETIONS, COLUMNS, timeout_seconds=30)


def test_a_column_named_as_a_library_keyword_is_an_error():
    with pytest.raises(ValueError, match="column 'trainer_state' has the name of an argument"):
        compute_rewards([ones], None, PROMPTS, COMPLETIONS, {"trainer_state": [1, 2, 3]})


def test_a_reward_of_the_script_sent_to_the_worker_warns_that_its_state_stays_there():
    seen = []

    def remembers(prompts, completions, **columns):  # defined here: sent by value, as a script's is
        seen.extend(completions)
        return [1.0] * len(completions)

    with pytest.warns(
        UserWarning, match=r"reward function 'remembers' is defined in your script .* state it"
    ):
        check_rewards([remembers], timeout_seconds=30)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_rewards([ones], timeout_seconds=30)  # a module's function: imported there, said nowhere
        check_rewards([remembers], timeout_seconds=None)  # no limit: it runs here
        remembers.in_process = True
        check_rewards([remembers], timeout_seconds=30)


def test_check_rewards_sends_each_limited_function_to_the_worker_before_any_scoring(monkeypatch):
    ghost = types.ModuleType("ghost_module")
    exec("def ghostly(prompts, completions, **columns):\n    return [1.0] * len(completions)", ghost.__dict__)
    monkeypatch.setitem(sys.modules, "ghost_module", ghost)
    check_rewards([ones, ghost.ghostly], timeout_seconds=None)  # no limit: both run here
    with pytest.raises(RewardNotSendableError, match=r"'ghostly'.*No module named 'ghost_module'"):
        check_rewards([ones, ghost.ghostly], timeout_seconds=30)
    ghost.ghostly.in_process = True
    check_rewards([ones, ghost.ghostly], timeout_seconds=30)
    with pytest.raises(TypeError, match="reward function 3 is not callable"):
        check_rewards([3], timeout_seconds=30)

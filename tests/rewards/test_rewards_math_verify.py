"""Tests for MathVerifyReward and extract_boxed, with a fake math_verify module (the package is optional).

The fake is a file on `sys.path`, so the reward's worker process, which gets this `sys.path`, imports it too;
with no SymPy to import, a worker starts in a fraction of a second.
"""

import copy
import gc
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import warnings

import pytest
from conftest import is_gone

from exgrpo_pl.rewards import MathVerifyReward, extract_boxed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{42}", "42"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{{a}{b{c}}}", "{a}{b{c}}"),
        (r"\boxed{\boxed{3}}", "3"),
        (r"\boxed {7}", "7"),
        (r"\boxed{}", ""),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{a \\ b}", r"a \\ b"),
        (r"\boxed{1} and \boxed{2", None),  # the last box is truncated
        (r"\boxed{\}", None),  # only an escaped closing brace
        (r"\boxed{", None),
        ("no box here", None),
        ("", None),
        (r"\boxed 5", None),
        (r"\boxedx{5}", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


FAKE_MATH_VERIFY = """
import hashlib
import re
import time


def parse(text, parsing_timeout=5):
    assert parsing_timeout is None, "math-verify's own parsing timeout is on"
    boxed = re.fullmatch(r"\\\\boxed\\{(.*)\\}", text, re.DOTALL)
    return [(text if boxed is None else boxed.group(1)).replace(" ", "")]


def verify(gold, target, timeout_seconds=5):
    assert timeout_seconds is None, "math-verify's own verify timeout is on"
    if gold == ["slow"]:
        time.sleep(60)
    if gold == ["in-c"]:
        hashlib.pbkdf2_hmac("sha256", b"", b"", 10**9)  # minutes in one C call, which no signal interrupts
    if gold == ["boom"]:
        raise ValueError("boom")
    return gold == target
"""
# Wall-clock allowance on top of a time limit, for a loaded CI machine (worker starts included).
SLACK = 3.0


@pytest.fixture
def fake_math_verify(tmp_path, monkeypatch):
    """A math_verify stand-in: parse strips \\boxed{} and spaces; verify compares, sleeps a minute on "slow",
    spends minutes in C on "in-c" and raises on "boom"; both raise when math-verify's own timeouts are on."""
    (tmp_path / "math_verify.py").write_text(FAKE_MATH_VERIFY)
    monkeypatch.syspath_prepend(tmp_path)
    monkeypatch.delitem(sys.modules, "math_verify", raising=False)
    return tmp_path


def worker_pid(reward):
    return reward._worker.process.pid


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'exgrpo-pl\[math\]'"):
        MathVerifyReward()


@pytest.mark.parametrize("timeout_seconds", [5.0, None], ids=["worker", "no-limit-in-process"])
def test_scores_last_box_against_answer(fake_math_verify, timeout_seconds):
    # The fake also checks that math-verify's own timeouts are off.
    reward = MathVerifyReward(timeout_seconds=timeout_seconds)
    scores = reward(
        ["p"] * 4,
        [r"first \boxed{1} final \boxed{ 2 }", r"\boxed{1}", "2", r"\boxed{2"],
        answer=["2", r"\boxed{2}", 2, "2"],
    )
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert (reward._worker is None) == (timeout_seconds is None)


def test_timeout_scores_zero_and_the_next_row_gets_a_new_worker(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=0.2)
    reward(["p"], ["ok"], answer=["ok"])
    first = worker_pid(reward)
    started = time.monotonic()
    with pytest.warns(UserWarning, match=r"ran over 0\.2s on answer 'slow'; scored 0\.0"):
        scores = reward(["p", "p"], ["slow", "ok"], answer=["slow", "ok"])
    assert time.monotonic() - started < 0.2 + SLACK
    assert scores == [0.0, 1.0]
    assert is_gone(first) and worker_pid(reward) != first


def test_time_limit_stops_work_inside_c(fake_math_verify):
    # A signal handler would wait for the C call to return; killing the worker does not.
    reward = MathVerifyReward(timeout_seconds=0.2)
    started = time.monotonic()
    with pytest.warns(UserWarning, match="ran over 0.2s on answer 'in-c'"):
        assert reward(["p", "p"], ["in-c", "ok"], answer=["in-c", "ok"]) == [0.0, 1.0]
    assert time.monotonic() - started < 0.2 + SLACK


def test_time_limit_holds_off_the_main_thread(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=0.2)
    results, caught = [], []

    def work():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            results.extend(reward(["p", "p"], ["slow", "3"], answer=["slow", "3"]))
        caught.extend(str(w.message) for w in record)

    started = time.monotonic()
    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=30)
    assert time.monotonic() - started < 0.2 + SLACK
    assert results == [0.0, 1.0]
    assert any("ran over 0.2s" in message for message in caught)


def test_worker_killed_mid_row_scores_zero_and_is_replaced(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=30.0)
    reward(["p"], ["ok"], answer=["ok"])
    pid = worker_pid(reward)
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    killer.start()
    started = time.monotonic()
    with pytest.warns(UserWarning, match=r"process died \(exit code -9\) on answer 'slow'; scored 0\.0"):
        assert reward(["p"], ["slow"], answer=["slow"]) == [0.0]
    assert time.monotonic() - started < SLACK  # not the 30 s limit: a dead worker is noticed at once
    killer.join()
    assert is_gone(pid)
    assert reward(["p"], ["ok"], answer=["ok"]) == [1.0]


def test_worker_killed_between_rows_is_replaced(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=5.0)
    reward(["p"], ["ok"], answer=["ok"])
    pid = worker_pid(reward)
    os.kill(pid, signal.SIGKILL)
    reward._worker.process.wait(timeout=10)
    with pytest.warns(UserWarning, match=r"exited between rows \(exit code -9\); starting a new one"):
        # The row is scored by a new worker, not lost.
        assert reward(["p", "p"], ["ok", "1"], answer=["ok", "2"]) == [1.0, 0.0]
    assert worker_pid(reward) != pid


def test_math_verify_errors_are_raised_with_the_workers_traceback(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=5.0)
    with pytest.raises(RuntimeError, match=r"(?s)failed on row 1 \(answer 'boom'\).*ValueError: boom"):
        reward(["p", "p"], ["ok", "boom"], answer=["ok", "boom"])
    pid = worker_pid(reward)
    assert reward(["p"], ["ok"], answer=["ok"]) == [1.0]
    assert worker_pid(reward) == pid  # an exception is not a crash: the worker goes on


def test_a_worker_that_cannot_start_is_an_error(fake_math_verify):
    (fake_math_verify / "math_verify.py").write_text("parse = verify = None\n")
    reward = MathVerifyReward(timeout_seconds=5.0)
    with pytest.raises(RuntimeError, match=r"warm-up call raised: .*NoneType"):
        reward(["p"], ["1"], answer=["1"])


def test_copies_start_their_own_worker(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=5.0, name="mv")
    reward(["p"], ["ok"], answer=["ok"])
    pid = worker_pid(reward)
    for clone in (copy.deepcopy(reward), pickle.loads(pickle.dumps(reward))):
        assert (clone.timeout_seconds, clone.name, clone._worker) == (5.0, "mv", None)
        assert clone(["p"], ["ok"], answer=["ok"]) == [1.0]
        assert worker_pid(clone) != pid
        clone.close()
    assert worker_pid(reward) == pid


def score_in_forked_child(reward, parent_worker, results):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        scores = reward(["p"], ["ok"], answer=["ok"])
    results.put((scores, worker_pid(reward) != parent_worker, [str(w.message) for w in caught]))
    reward.close()


def test_a_forked_copy_starts_its_own_worker(fake_math_verify):
    # As under a fork-based DDP launcher: the child must neither use nor stop the parent's worker.
    reward = MathVerifyReward(timeout_seconds=5.0)
    reward(["p"], ["ok"], answer=["ok"])
    pid = worker_pid(reward)
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()
    child = context.Process(target=score_in_forked_child, args=(reward, pid, results))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0 and results.get() == ([1.0], True, [])  # its own worker, started quietly
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "exited between rows": the parent's worker is still running
        assert reward(["p"], ["ok"], answer=["ok"]) == [1.0]
    assert worker_pid(reward) == pid


def test_close_and_collection_stop_the_worker(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=5.0)
    reward(["p"], ["ok"], answer=["ok"])
    pid = worker_pid(reward)
    reward.close()
    assert is_gone(pid) and reward._worker is None
    assert reward(["p"], ["ok"], answer=["ok"]) == [1.0]  # a later call starts a new one
    pid = worker_pid(reward)
    del reward
    gc.collect()
    assert is_gone(pid)


def test_rejects_non_positive_timeout(fake_math_verify):
    with pytest.raises(ValueError, match="timeout_seconds"):
        MathVerifyReward(timeout_seconds=0)

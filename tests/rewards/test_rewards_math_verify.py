"""Tests for MathVerifyReward and extract_boxed, with a fake math_verify module (the package is optional)."""

import sys
import threading
import time
import types

import pytest

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


@pytest.fixture
def fake_math_verify(monkeypatch):
    """A math_verify stand-in: parse strips \\boxed{} and spaces; verify compares, or sleeps on "slow"."""
    module = types.ModuleType("math_verify")
    calls = []

    def parse(text, parsing_timeout=5):
        calls.append(("parse", text, parsing_timeout))
        inner = extract_boxed(text)
        return [(text if inner is None else inner).replace(" ", "")]

    def verify(gold, target, timeout_seconds=5):
        calls.append(("verify", gold, target, timeout_seconds))
        if gold == ["slow"]:
            time.sleep(10)
        return gold == target

    module.parse, module.verify, module.calls = parse, verify, calls
    monkeypatch.setitem(sys.modules, "math_verify", module)
    return module


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'exgrpo-pl\[math\]'"):
        MathVerifyReward()


def test_scores_last_box_against_answer(fake_math_verify):
    reward = MathVerifyReward()
    scores = reward(
        ["p"] * 4,
        [r"first \boxed{1} final \boxed{ 2 }", r"\boxed{1}", "2", r"\boxed{2"],
        answer=["2", r"\boxed{2}", 2, "2"],
    )
    assert scores == [1.0, 0.0, 1.0, 0.0]


def test_own_timeouts_of_math_verify_are_off(fake_math_verify):
    MathVerifyReward()(["p"], [r"\boxed{1}"], answer=["1"])
    assert [call[-1] for call in fake_math_verify.calls] == [None, None, None]


def test_timeout_fires_and_scores_zero(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=0.2)
    started = time.monotonic()
    with pytest.warns(UserWarning, match="ran over 0.2s"):
        scores = reward(["p", "p"], ["slow", "ok"], answer=["slow", "ok"])
    assert time.monotonic() - started < 1.5
    assert scores == [0.0, 1.0]


def test_timeout_restores_an_outer_timer(fake_math_verify):
    import signal

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        MathVerifyReward(timeout_seconds=0.1)(["p"], ["1"], answer=["1"])
        time.sleep(0.4)
        assert fired == [True]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_main_thread_runs_without_limit_and_warns(fake_math_verify):
    reward = MathVerifyReward(timeout_seconds=1.0)
    results, caught = [], []

    def work():
        import warnings

        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            results.extend(reward(["p"], ["3"], answer=["3"]))
        caught.extend(str(w.message) for w in record)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == [1.0]
    assert any("main thread" in message for message in caught)


def test_rejects_non_positive_timeout(fake_math_verify):
    with pytest.raises(ValueError, match="timeout_seconds"):
        MathVerifyReward(timeout_seconds=0)

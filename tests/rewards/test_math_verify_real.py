"""MathVerifyReward with the real math-verify package: equivalent forms, wrong, malformed, empty, huge and
adversarial answers, and the per-row time limit firing on answers that really hang math-verify.

The pathological answers were found by experiment with math-verify 0.9 / SymPy 1.14: verifying
`9^{9^{9^{9}}}` against a number runs for minutes (SymPy evaluates the tower), and parsing deeply nested
parentheses grows exponentially with the depth (in ANTLR's parser; depth 10 already takes about half a
second, and depth 50 takes 15 to 25 s).

The tests share one reward per time limit, so most rows reuse a running worker; every row after a timeout
pays for a new one (about a second).
"""

import functools
import threading
import time
import warnings
from pathlib import Path

import pytest

pytest.importorskip("math_verify")

from exgrpo_pl.data import load_rows  # noqa: E402
from exgrpo_pl.rewards import MathVerifyReward  # noqa: E402

MATH = Path(__file__).parents[1] / "data" / "samples" / "math_problem_solution.jsonl"
MATH_COLUMNS = {"prompt_column": "problem", "answer_column": "solution", "answer_from": "boxed"}
TOWER = r"\boxed{9^{9^{9^{9}}}}"
NESTED = r"\boxed{" + "(" * 50 + "1" + ")" * 50 + "}"
# Wall-clock allowance on top of the time limit, for a loaded CI machine.
SLACK = 2.0
# Wall-clock allowance for starting a worker (a fresh interpreter importing SymPy) on a loaded machine.
START = 5.0


@functools.cache
def shared_reward(timeout_seconds):
    return MathVerifyReward(timeout_seconds=timeout_seconds)


def score(completion, answer, timeout_seconds=1.0):
    """Scores one row, ignoring time-limit warnings; asserts a float 0.0/1.0 within the limit plus slack."""
    reward = shared_reward(timeout_seconds)
    assert reward(["p"], [r"\boxed{1}"], answer=["1"]) == [1.0]  # a running worker: its start is not timed
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="math-verify ran over")
        (value,) = reward(["p"], [completion], answer=[answer])
    elapsed = time.monotonic() - started
    assert type(value) is float and value in (0.0, 1.0)
    assert elapsed < timeout_seconds + SLACK, f"took {elapsed:.2f}s"
    return value


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        (r"\boxed{\frac{1}{2}}", "0.5"),
        (r"So $x = \boxed{0.5}$.", r"\frac{1}{2}"),
        (r"\boxed{1+2x}", "2x+1"),
        (r"\boxed{2x+1}", r"\boxed{1+2x}"),  # a boxed reference is unwrapped too
        (r"\boxed{3/4}", "0.75"),
        (r"\boxed{0.75}", r"\frac{3}{4}"),
        (r"\boxed{\frac{3}{2}}", "1.5"),
        (r"\boxed{\sqrt{50}}", r"5\sqrt{2}"),
        (r"First \boxed{1}, no wait: \boxed{12}", "12"),
        ("The answer is 6.", "6"),  # no box: the whole completion is parsed
        (r"\boxed{12}", 12),  # a numeric answer column
    ],
)
def test_equivalent_forms_score_one(completion, answer):
    assert score(completion, answer) == 1.0


@pytest.mark.parametrize(
    ("completion", "answer"),
    [
        (r"\boxed{7}", "6"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{2x-1}", "2x+1"),
        (r"\boxed{0.76}", "3/4"),
        (r"\boxed{12} was wrong, it is \boxed{13}", "12"),  # the last box counts
    ],
)
def test_wrong_answers_score_zero(completion, answer):
    assert score(completion, answer) == 0.0


def test_math_sample_answers_verify():
    # The answers load_rows takes from the MATH-style sample's boxes, checked in another form.
    answers = [row["answer"] for row in load_rows(MATH, **MATH_COLUMNS)]
    others = ["0.5", "6", "1+2x", "12.0", "5", r"\sqrt{50}"]
    scores = [score(rf"The answer is $\boxed{{{other}}}$.", answer) for other, answer in zip(others, answers)]
    assert scores == [1.0] * len(answers)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"\boxed{\frac{1}{2", "0.5", 0.0),  # truncated generation: the box never closes
        (r"\boxed{", "1", 0.0),
        (r"$$\boxed{1", "1", 0.0),
        (r"\boxed{\frac{1}{}}", "1", 0.0),
        (r"\boxed{\frac}", "1", 0.0),
        (r"\boxed{)(}", "1", 0.0),
        (r"\boxed{\begin{matrix}1", "1", 0.0),
        ("}{", "1", 0.0),
        ("\\boxed{\x00\ufffd}", "1", 0.0),
        (r"\boxed{1}", r"\frac{1}{2", 0.0),  # a malformed reference
        (r"\boxed{1}}}}", "1", None),  # stray closing braces: either score is acceptable
        (r"\frac{1}{2}}}", "0.5", None),
        (r"\boxed{\left( 1}", "1", None),
    ],
)
def test_malformed_latex_scores_without_raising(completion, answer, expected):
    value = score(completion, answer)
    if expected is not None:
        assert value == expected


@pytest.mark.parametrize(
    ("completion", "answer"),
    [("", "1"), ("   \n\t", "1"), (r"\boxed{}", "1"), (r"\boxed{ }", "1"), (r"\boxed{1}", ""), ("", "")],
)
def test_empty_scores_zero(completion, answer):
    assert score(completion, answer) == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "7" * 200_000,
        r"\boxed{" + "7" * 200_000 + "}",
        r"\frac{1}{2}+" * 16_000,
        r"\boxed{" + r"\frac{1}{2}+" * 16_000 + "}",
        "{" * 100_000,
        r"\boxed{" * 10_000,
        "x" * 200_000,
    ],
    ids=["digits", "boxed-digits", "fracs", "boxed-fracs", "open-braces", "open-boxes", "letters"],
)
def test_huge_completions_score_zero_in_time(completion):
    assert len(completion) >= 70_000
    assert score(completion, "1") == 0.0


def test_huge_completion_with_a_correct_final_box():
    # A long reasoning trace: only the final box goes to math-verify.
    assert score("Let me think. " * 15_000 + r"\boxed{\frac{1}{2}}", "0.5") == 1.0


# Each row that times out costs the next row a worker start (about a second): the default run keeps the
# nested parentheses, which hang the parser (test_time_limit_fires has the tower, which hangs SymPy); the
# others are slow tests.
@pytest.mark.parametrize(
    "completion",
    [
        pytest.param(TOWER, id="tower", marks=pytest.mark.slow),
        pytest.param(NESTED, id="nested-parens"),
        pytest.param(r"\boxed{9^{9^{9}}}", id="tower3", marks=pytest.mark.slow),
        pytest.param(r"\boxed{2^{2^{30}}}", id="double-power", marks=pytest.mark.slow),
        pytest.param(r"\boxed{10^{10^{8}}}", id="huge-power", marks=pytest.mark.slow),
        pytest.param(r"\boxed{(10^{8})!}", id="factorial", marks=pytest.mark.slow),
        pytest.param(r"\boxed{100!!}", id="double-factorial", marks=pytest.mark.slow),
    ],
)
def test_adversarial_answers_score_zero_in_time(completion):
    assert score(completion, "1", timeout_seconds=0.5) == 0.0


@pytest.mark.parametrize("completion", [TOWER, NESTED], ids=["verify-hangs", "parse-hangs"])
def test_time_limit_fires(completion):
    reward = shared_reward(0.5)
    assert reward(["p"], ["1"], answer=["1"]) == [1.0]  # a running worker
    started = time.monotonic()
    with pytest.warns(UserWarning, match=r"math-verify ran over 0\.5s on answer '1'; scored 0\.0"):
        assert reward(["p"], [completion], answer=["1"]) == [0.0]
    assert time.monotonic() - started < 0.5 + SLACK
    # The worker that had the row is gone; the next row gets a new one.
    assert reward._worker is None
    assert reward(["p"], [r"\boxed{\frac{1}{2}}"], answer=["0.5"]) == [1.0]


def test_each_row_gets_its_own_limit():
    reward = shared_reward(0.5)
    completions = [r"\boxed{2}", TOWER, r"\boxed{0.25}", NESTED, r"\boxed{5}"]
    started = time.monotonic()
    with pytest.warns(UserWarning, match="ran over"):
        scores = reward(["p"] * 5, completions, answer=["2", "1", r"\frac{1}{4}", "1", "6"])
    assert scores == [1.0, 0.0, 1.0, 0.0, 0.0]
    # Up to three worker starts: maybe the first row's, and one after each timeout.
    assert time.monotonic() - started < 2 * 0.5 + 3 * START + SLACK


def test_time_limit_holds_off_the_main_thread():
    reward = shared_reward(0.5)
    assert reward(["p"], ["1"], answer=["1"]) == [1.0]  # a running worker
    results, elapsed = [], []

    def work():
        started = time.monotonic()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="math-verify ran over")
            results.extend(reward(["p"], [NESTED], answer=["1"]))
        elapsed.append(time.monotonic() - started)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=60)
    assert results == [0.0]
    assert elapsed[0] < 0.5 + SLACK, f"took {elapsed[0]:.2f}s"

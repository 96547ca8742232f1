"""Math data layouts: the sample files in tests/data/samples through load_rows and PromptDataModule, and
answer_from="boxed" (the answer is the last \\boxed{} of a worked solution)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exgrpo_pl.batch import text_id
from exgrpo_pl.data import PromptDataModule, load_rows
from exgrpo_pl.rewards import extract_boxed

SAMPLES = Path(__file__).parent / "samples"
MATH = SAMPLES / "math_problem_solution.jsonl"
PROMPT_ANSWER = SAMPLES / "math_prompt_answer.parquet"
OPENR1 = SAMPLES / "openr1_style.jsonl"

MATH_COLUMNS = {"prompt_column": "problem", "answer_column": "solution", "answer_from": "boxed"}
OPENR1_COLUMNS = {"prompt_column": "problem", "answer_column": "answer"}

MATH_ANSWERS = [r"\frac{1}{2}", "6", "2x+1", "12", "5", r"5\sqrt{2}"]
PROMPT_ANSWER_ANSWERS = ["42", "0.75", r"\frac{3}{4}", "4", "1024", r"\frac{1}{2}"]
OPENR1_ANSWERS = ["15", "9", r"\frac{3}{2}", "21", "5"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- the sample files through load_rows ---


def test_math_problem_solution_sample():
    rows = load_rows(MATH, **MATH_COLUMNS)
    assert [row["answer"] for row in rows] == MATH_ANSWERS
    assert rows[0]["prompt"].startswith("What is $\\frac{1}{4}")
    assert rows[0]["id"] == text_id(rows[0]["prompt"])
    assert {"level", "type"} <= set(rows[0]) and "solution" not in rows[0] and "problem" not in rows[0]


def test_math_sample_without_boxed_keeps_the_whole_solution():
    # The default is unchanged: the answer column as it is.
    rows = load_rows(MATH, prompt_column="problem", answer_column="solution")
    assert all(r"\boxed{" in row["answer"] for row in rows)
    assert [extract_boxed(row["answer"]) for row in rows] == MATH_ANSWERS


def test_prompt_answer_parquet_sample():
    rows = load_rows(PROMPT_ANSWER)
    assert [row["answer"] for row in rows] == PROMPT_ANSWER_ANSWERS
    assert set(rows[0]) == {"id", "prompt", "answer"}


def test_openr1_style_sample_keeps_solution_and_uuid():
    rows = load_rows(OPENR1, **OPENR1_COLUMNS)
    assert [row["answer"] for row in rows] == OPENR1_ANSWERS
    assert set(rows[0]) == {"id", "prompt", "answer", "solution", "uuid"}
    # The sample is consistent: each solution boxes its answer.
    assert [extract_boxed(row["solution"]) for row in rows] == OPENR1_ANSWERS


def test_openr1_style_uuid_as_question_id():
    uuids = [json.loads(line)["uuid"] for line in OPENR1.read_text().splitlines()]
    rows = load_rows(OPENR1, id_column="uuid", **OPENR1_COLUMNS)
    assert [row["id"] for row in rows] == [text_id(uuid) for uuid in uuids]
    assert "uuid" not in rows[0]  # consumed into `id`, like the other named columns


# --- the sample files through PromptDataModule ---


@pytest.mark.parametrize(
    ("path", "columns", "answers", "extra"),
    [
        (MATH, MATH_COLUMNS, MATH_ANSWERS, {"level", "type"}),
        (PROMPT_ANSWER, {}, PROMPT_ANSWER_ANSWERS, set()),
        (OPENR1, OPENR1_COLUMNS, OPENR1_ANSWERS, {"solution", "uuid"}),
    ],
    ids=["problem-solution", "prompt-answer", "openr1"],
)
def test_datamodule_reads_each_layout(path, columns, answers, extra):
    dm = PromptDataModule(train_path=str(path), val_path=str(path), batch_size=2, drop_last=False, **columns)
    dm.setup("fit")
    train = list(dm.train_dataloader())
    assert set(train[0]) == {"prompt", "answer", "question_id"} | extra
    assert sorted(answer for batch in train for answer in batch["answer"]) == sorted(answers)
    val = list(dm.val_dataloader())
    assert [answer for batch in val for answer in batch["answer"]] == answers  # file order
    assert dm.hparams.answer_from == columns.get("answer_from", "column")


def test_datamodule_split_of_math_sample():
    dm = PromptDataModule(train_path=str(MATH), val_fraction=0.34, batch_size=2, **MATH_COLUMNS)
    dm.setup("fit")
    assert len(dm.train_rows) + len(dm.val_rows) == len(MATH_ANSWERS) and dm.val_rows
    assert sorted(row["answer"] for row in dm.train_rows + dm.val_rows) == sorted(MATH_ANSWERS)


# --- answer_from="boxed" ---


@pytest.mark.parametrize(
    ("solution", "answer"),
    [
        (r"So the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"$\boxed{\sqrt{\frac{a}{b}}}$", r"\sqrt{\frac{a}{b}}"),
        (r"First $\boxed{1}$, then finally $\boxed{\frac{2}{3}}$.", r"\frac{2}{3}"),  # the last box
        (r"The set is $\boxed{\{1, 2\}}$.", r"\{1, 2\}"),  # escaped braces
        (r"$\boxed{ 7 }$", "7"),  # surrounding spaces dropped
        (r"\boxed{\text{(A)}}", r"\text{(A)}"),
    ],
)
def test_boxed_extraction(tmp_path, solution, answer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "p", "solution": solution}])
    assert load_rows(path, **MATH_COLUMNS)[0]["answer"] == answer


def test_boxed_from_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "p", "solution": r"x = \boxed{\frac{1}{2}}"}]), path)
    assert load_rows(path, **MATH_COLUMNS)[0]["answer"] == r"\frac{1}{2}"


@pytest.mark.parametrize(
    "solution",
    [
        "The answer is 4.",  # no box
        r"The answer is \boxed{4",  # never closed
        r"\boxed{4} and then \boxed{5",  # the last box is never closed
        r"\fbox{4}",
        4,  # a number has no box either
    ],
)
def test_missing_box_names_file_row_and_column(tmp_path, solution):
    rows = [{"problem": "ok", "solution": r"\boxed{1}"}, {"problem": "bad", "solution": solution}]
    path = write_jsonl(tmp_path / "math.jsonl", rows)
    with pytest.raises(ValueError, match=r"math\.jsonl: line 2: column 'solution' has no complete \\boxed"):
        load_rows(path, **MATH_COLUMNS)


def test_missing_box_in_parquet_names_row(tmp_path):
    path = tmp_path / "math.parquet"
    rows = [{"problem": f"p{i}", "solution": rf"\boxed{{{i}}}"} for i in range(3)]
    rows.append({"problem": "p3", "solution": "no box"})
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(ValueError, match=r"math\.parquet: row 4: column 'solution'"):
        load_rows(path, **MATH_COLUMNS)


def test_empty_box_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "p", "solution": r"so \boxed{ }"}])
    with pytest.raises(ValueError, match=r"math\.jsonl: line 1: the last \\boxed\{\} in column 'solution'"):
        load_rows(path, **MATH_COLUMNS)


def test_missing_box_error_through_datamodule(tmp_path):
    path = write_jsonl(tmp_path / "math.jsonl", [{"problem": "p", "solution": "4"}])
    dm = PromptDataModule(train_path=str(path), val_fraction=0.0, **MATH_COLUMNS)
    with pytest.raises(ValueError, match=r"math\.jsonl: line 1: column 'solution'"):
        dm.setup("fit")


# --- answer_from validation ---


@pytest.mark.parametrize("bad", ["last_box", "Boxed", "", None])
def test_answer_from_is_validated(bad):
    allowed = r"answer_from must be one of 'column', 'boxed'"
    with pytest.raises(ValueError, match=allowed):
        load_rows(MATH, **{**MATH_COLUMNS, "answer_from": bad})
    with pytest.raises(ValueError, match=allowed):
        PromptDataModule(train_path=str(MATH), **{**MATH_COLUMNS, "answer_from": bad})


def test_answer_from_is_checked_before_reading(tmp_path):
    with pytest.raises(ValueError, match="answer_from"):
        load_rows(tmp_path / "missing.jsonl", answer_from="box")

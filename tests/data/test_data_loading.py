"""Tests for load_rows and split_rows: formats, normalization, and errors that name file, row and column."""

import json
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exgrpo_pl.data import load_rows, split_rows

ROWS = [
    {"question": "What is 2+2?", "solution": 4, "level": "easy", "source": "a"},
    {"question": "What is 3*3?", "solution": "9", "level": "hard", "source": "b"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def load(path, **kwargs):
    return load_rows(path, prompt_column="question", answer_column="solution", **kwargs)


def check_normalized(rows):
    assert [row["prompt"] for row in rows] == ["What is 2+2?", "What is 3*3?"]
    assert [row["answer"] for row in rows] == ["4", "9"]  # numbers become strings
    assert rows[0]["id"] == zlib.crc32(b"What is 2+2?")
    assert rows[1]["source"] == "b" and rows[1]["level"] == "hard"  # other columns kept
    assert "question" not in rows[0] and "solution" not in rows[0]


def test_jsonl(tmp_path):
    check_normalized(load(write_jsonl(tmp_path / "d.jsonl", ROWS)))


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n\n")
    check_normalized(load(path))


def test_json(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS))
    check_normalized(load(path))


def test_parquet(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{**row, "solution": str(row["solution"])} for row in ROWS]), path)
    check_normalized(load(path))


def test_saved_dataset_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{**row, "solution": str(row["solution"])} for row in ROWS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    check_normalized(load(tmp_path / "ds"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"several splits \(train\)"):
        load(tmp_path / "dd")


def test_id_and_domain_columns(tmp_path):
    rows = [{**row, "uid": uid} for row, uid in zip(ROWS, [7, "q-8"], strict=True)]
    out = load(write_jsonl(tmp_path / "d.jsonl", rows), id_column="uid", domain_column="level")
    assert [row["id"] for row in out] == [7, zlib.crc32(b"q-8")]
    assert [row["domain"] for row in out] == ["easy", "hard"]
    assert "uid" not in out[0] and "level" not in out[0]


def test_ids_do_not_depend_on_row_order(tmp_path):
    forward = load(write_jsonl(tmp_path / "a.jsonl", ROWS))
    backward = load(write_jsonl(tmp_path / "b.jsonl", ROWS[::-1]))
    assert {r["prompt"]: r["id"] for r in forward} == {r["prompt"]: r["id"] for r in backward}


def test_missing_column_names_file_line_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"question": "x"}])
    with pytest.raises(
        ValueError, match=r"d\.jsonl: line 2: missing column 'solution'; columns present: \['question'\]"
    ):
        load(path)


def test_missing_column_in_json_names_row(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([ROWS[0], ROWS[1], {"solution": "1"}]))
    with pytest.raises(ValueError, match=r"d\.json: row 3: missing column 'question'"):
        load(path)


@pytest.mark.parametrize("answer", ["", "   \n", None])
def test_empty_answer_names_file_and_row(tmp_path, answer):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"question": "q", "solution": answer}])
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2: column 'solution'"):
        load(path)


def test_empty_prompt_in_parquet_names_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": "q", "solution": "1"}, {"question": " ", "solution": "2"}]), path
    )
    with pytest.raises(ValueError, match=r"d\.parquet: row 2: column 'question' is empty"):
        load(path)


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + '{"question": "x", \n')
    with pytest.raises(ValueError, match=r"d\.jsonl:2: malformed JSON"):
        load(path)


def test_non_object_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"line 1: expected an object"):
        load(path)


def test_duplicate_prompt_names_both_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[1], ROWS[0]])
    with pytest.raises(
        ValueError, match=r"d\.jsonl: line 1 and line 3 have the same id .* \(identical prompts\)"
    ):
        load(path)


def test_duplicate_id_column_names_both_rows(tmp_path):
    rows = [{**ROWS[0], "uid": 5}, {**ROWS[1], "uid": "5"}]
    with pytest.raises(ValueError, match=r"line 1 and line 2 have the same id 5"):
        load(write_jsonl(tmp_path / "d.jsonl", rows), id_column="uid")


def test_unused_id_column_is_not_silently_replaced(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{**ROWS[0], "id": 3}])
    with pytest.raises(ValueError, match="pass id_column='id'"):
        load(path)
    assert load(path, id_column="id")[0]["id"] == 3


def test_clashing_column_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{**ROWS[0], "answer": "x"}])
    with pytest.raises(ValueError, match="column 'answer' would be replaced by column 'solution'"):
        load(path)


def test_non_text_answer_rejected(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "solution": [1, 2]}])
    with pytest.raises(ValueError, match="column 'solution' must be text, got list"):
        load(path)


def test_file_level_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load(tmp_path / "d.csv")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load(tmp_path / "e.jsonl")
    (tmp_path / "o.json").write_text("{}")
    with pytest.raises(ValueError, match="expected a JSON list"):
        load(tmp_path / "o.json")


def test_split_rows_depends_on_ids_not_order():
    rows = [{"id": i, "domain": "ab"[i % 2]} for i in range(100)]
    train, val = split_rows(rows, 0.2, seed=1)
    _, val_reversed = split_rows(rows[::-1], 0.2, seed=1)
    assert {r["id"] for r in val} == {r["id"] for r in val_reversed}
    assert len(val) == 20 and sum(r["domain"] == "a" for r in val) == 10
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in val)
    with pytest.raises(ValueError, match="val_fraction"):
        split_rows(rows, 1.0)

"""Tests for load_rows and split_rows: formats, normalization, and errors that name file, row and column;
nested columns named by dotted paths and chat-message prompts (the paper's verl layout)."""

import json
import warnings
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exgrpo_pl.batch import text_id
from exgrpo_pl.data import load_rows, split_rows
from exgrpo_pl.data.loading import find_row

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
    assert rows[0]["id"] == text_id("What is 2+2?")
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
    assert [row["id"] for row in out] == [7, text_id("q-8")]
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


def test_repeated_prompt_and_answer_kept_once_with_one_warning(tmp_path):
    # Real datasets (OpenR1-Math, MATH) repeat questions; a repeat with the same answer is harmless.
    rows = [ROWS[0], ROWS[1], ROWS[0], {**ROWS[0], "source": "c"}, ROWS[1]]
    with pytest.warns(UserWarning) as caught:
        out = load(write_jsonl(tmp_path / "d.jsonl", rows))
    assert [row["prompt"] for row in out] == ["What is 2+2?", "What is 3*3?"]
    assert out[0]["source"] == "a"  # the first row's other columns are the ones kept
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"{tmp_path / 'd.jsonl'}: dropped 3 rows that repeat an earlier row's prompt and answer: "
        "line 3 (repeats line 1), line 4 (repeats line 1), line 5 (repeats line 2); "
        "each question is kept once"
    )


def test_repeat_warning_names_only_the_first_five(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([ROWS[0]] * 9))
    with pytest.warns(
        UserWarning, match=r"dropped 8 rows .*: row 2 \(repeats row 1\), .*row 6 \(repeats row 1\) and 3 more"
    ):
        assert len(load(path)) == 1


def test_no_warning_without_repeats(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(write_jsonl(tmp_path / "d.jsonl", ROWS))


def test_repeated_prompt_with_another_answer_names_both_rows_and_answers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[1], {**ROWS[0], "solution": "5"}])
    with pytest.raises(
        ValueError,
        match=r"d\.jsonl: line 1 and line 3 have the same prompt but different answers: '4' and '5'; "
        r"a question takes one reference answer",
    ):
        load(path)


def test_answers_are_compared_after_normalization(tmp_path):
    # 4 and "4" are the same answer once numbers become strings; so are two solutions boxing the same answer.
    rows = [{"question": "q", "solution": 4}, {"question": "q", "solution": "4"}]
    with pytest.warns(UserWarning, match="dropped 1 rows"):
        assert len(load(write_jsonl(tmp_path / "a.jsonl", rows))) == 1
    rows = [{"question": "q", "solution": r"so \boxed{4}"}, {"question": "q", "solution": r"thus \boxed{4}."}]
    with pytest.warns(UserWarning, match="dropped 1 rows"):
        assert len(load(write_jsonl(tmp_path / "b.jsonl", rows), answer_from="boxed")) == 1


def test_prompts_whose_crc32_collide_get_different_ids():
    first, second = "What is 29685295+1?", "What is 32060020+1?"
    assert zlib.crc32(first.encode()) == zlib.crc32(second.encode())
    assert text_id(first) != text_id(second)


def test_prompts_whose_hashed_ids_collide_are_an_error_not_a_repeat(tmp_path, monkeypatch):
    monkeypatch.setattr("exgrpo_pl.data.loading.text_id", lambda text: 7)  # a hash that always collides
    rows = [{"question": "What is 1+1?", "solution": "2"}, {"question": "What is 2+1?", "solution": "3"}]
    with pytest.raises(
        ValueError, match=r"line 1 and line 2 have different prompts whose 63-bit hashed ids collide"
    ):
        load(write_jsonl(tmp_path / "d.jsonl", rows))
    rows = [{**row, "uid": i} for i, row in enumerate(rows)]  # integer ids do not collide
    assert len(load(write_jsonl(tmp_path / "e.jsonl", rows), id_column="uid")) == 2


def test_repeated_id_with_another_prompt_names_both_rows(tmp_path):
    rows = [{**ROWS[0], "uid": 5}, {**ROWS[1], "uid": "5"}]
    with pytest.raises(
        ValueError,
        match=r"line 1 and line 2 have the same 'uid' \(5\) but different prompts: 'What is 2\+2\?' and "
        r"'What is 3\*3\?'",
    ):
        load(write_jsonl(tmp_path / "d.jsonl", rows), id_column="uid")


def test_repeated_id_with_another_answer_names_both_answers(tmp_path):
    rows = [{**ROWS[0], "uid": "q-1"}, {**ROWS[0], "solution": "5", "uid": "q-1"}]
    with pytest.raises(ValueError, match=r"same 'uid' \(q-1\) but different answers: '4' and '5'"):
        load(write_jsonl(tmp_path / "d.jsonl", rows), id_column="uid")


def test_repeated_id_with_the_same_row_kept_once(tmp_path):
    rows = [{**ROWS[0], "uid": 5}, {**ROWS[1], "uid": 6}, {**ROWS[0], "uid": "5"}]
    with pytest.warns(
        UserWarning, match=r"dropped 1 rows that repeat an earlier row's 'uid', prompt and answer"
    ):
        out = load(write_jsonl(tmp_path / "d.jsonl", rows), id_column="uid")
    assert [row["id"] for row in out] == [5, 6]


def test_same_prompt_under_different_ids_is_two_questions(tmp_path):
    rows = [{**ROWS[0], "uid": 1}, {**ROWS[0], "solution": "5", "uid": 2}]
    assert [row["answer"] for row in load(write_jsonl(tmp_path / "d.jsonl", rows), id_column="uid")] == [
        "4",
        "5",
    ]


def latin1_lines():
    """Two JSON lines, the second with non-ASCII text, as Latin-1 bytes; and the offset of its first "û"."""
    second = {"question": "Combien coûte un café?", "solution": "2"}
    text = json.dumps(ROWS[0]) + "\n" + json.dumps(second, ensure_ascii=False) + "\n"
    data = text.encode("latin-1")
    return data, data.index("û".encode("latin-1"))


def test_latin1_jsonl_names_file_line_and_byte_offset(tmp_path):
    data, offset = latin1_lines()
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    column = offset - (data.index(b"\n") + 1) + 1  # 1-based, from the start of line 2
    with pytest.raises(
        ValueError,
        match=rf"d\.jsonl:2: not UTF-8: byte 0xfb at byte offset {offset} \(byte {column} of the line\)",
    ):
        load(path)


def test_latin1_json_names_file_line_and_byte_offset(tmp_path):
    data, offset = latin1_lines()
    path = tmp_path / "d.json"
    path.write_bytes(b"[" + data.replace(b"\n", b",\n", 1).rstrip(b"\n") + b"]")
    with pytest.raises(ValueError, match=rf"d\.json:2: not UTF-8: byte 0xfb at byte offset {offset + 2} "):
        load(path)


def test_utf8_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in ROWS), encoding="utf-8-sig")
    check_normalized(load(path))
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS), encoding="utf-8-sig")
    check_normalized(load(path))


def test_unused_id_column_is_not_silently_replaced(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{**ROWS[0], "id": 3}])
    with pytest.raises(ValueError, match="pass id_column='id'"):
        load(path)
    assert load(path, id_column="id")[0]["id"] == 3


def test_clashing_column_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{**ROWS[0], "answer": "x"}])
    with pytest.raises(ValueError, match="column 'answer' would be replaced by column 'solution'"):
        load(path)


@pytest.mark.parametrize("answer", ["15\u0000", "\u001b[1m15", "15\u007f"])
def test_an_answer_with_a_control_character_is_an_error_naming_file_and_line(tmp_path, answer):
    rows = [*ROWS, {"question": "q", "solution": "7\t"}, {"question": "r", "solution": answer}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)  # a tab, as in a copied table, is fine
    with pytest.raises(ValueError, match=r"d\.jsonl: line 4: column 'solution' holds control character"):
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


def test_the_loader_iterator_counts_what_it_yielded():
    """`ResumableLoader` reads torchdata's private `_num_yielded` to know whether its pass is finished."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    iterator = iter(StatefulDataLoader(list(range(6)), batch_size=2))
    assert iterator._num_yielded == 0
    next(iterator), next(iterator)
    assert iterator._num_yielded == 2 and len(iterator) == 3


# Nested columns (dotted paths) and message-list prompts: the paper's (verl's) layout


def verl_row(question, answer, system="Reason step by step.", **extra):
    return {
        "data_source": "math500",
        "prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "reward_model": {"ground_truth": answer, "style": "rule"},
        **extra,
    }


def load_verl(path, **kwargs):
    return load_rows(path, prompt_column="prompt", answer_column="reward_model.ground_truth", **kwargs)


def canonical_id(messages):
    return text_id(json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":")))


def test_a_dotted_path_reads_a_nested_column_which_stays_whole(tmp_path):
    rows = [verl_row("What is 1+1?", "2"), verl_row("What is 2+2?", 4)]
    out = load_verl(write_jsonl(tmp_path / "d.jsonl", rows), domain_column="data_source")
    assert [row["answer"] for row in out] == ["2", "4"]  # numbers become strings here too
    assert [row["domain"] for row in out] == ["math500", "math500"] and "data_source" not in out[0]
    assert out[0]["reward_model"] == {"ground_truth": "2", "style": "rule"}  # reward functions get it


def test_a_column_named_with_a_dot_is_found_by_its_full_name_first(tmp_path):
    rows = [{"q": "x", "a.b": "by name", "a": {"b": "by path"}}, {"q": "y", "a": {"b": "by path"}}]
    out = load_rows(write_jsonl(tmp_path / "d.jsonl", rows), prompt_column="q", answer_column="a.b")
    assert [row["answer"] for row in out] == ["by name", "by path"]
    assert "a.b" not in out[0] and out[0]["a"] == {"b": "by path"}  # a column read by name is renamed


@pytest.mark.parametrize(
    "second, message",
    [
        (
            {"prompt": "q", "reward_model": {"style": "rule"}},
            r"d\.jsonl: line 2: missing column 'reward_model\.ground_truth': 'reward_model' has no key "
            r"'ground_truth'; its keys: \['style'\]",
        ),
        (
            {"prompt": "q", "reward": {"ground_truth": "1"}},
            r"d\.jsonl: line 2: missing column 'reward_model\.ground_truth'; columns present: "
            r"\['prompt', 'reward'\]",
        ),
        (
            {"prompt": "q", "reward_model": "1"},
            r"d\.jsonl: line 2: missing column 'reward_model\.ground_truth': 'reward_model' is str, not an "
            r"object with keys",
        ),
    ],
)
def test_a_missing_dotted_path_names_file_row_path_and_the_keys_where_it_broke(tmp_path, second, message):
    first = {"prompt": "p", "reward_model": {"ground_truth": "1"}}
    with pytest.raises(ValueError, match=message):
        load_verl(write_jsonl(tmp_path / "d.jsonl", [first, second]))


def test_a_missing_dotted_path_in_parquet_names_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row("q", "1", extra_info={"index": 0})]), path)
    with pytest.raises(
        ValueError,
        match=r"d\.parquet: row 1: missing column 'extra_info\.uid': 'extra_info' has no key 'uid'; "
        r"its keys: \['index'\]",
    ):
        load_verl(path, id_column="extra_info.uid")
    assert load_verl(path, id_column="extra_info.index")[0]["id"] == 0


def test_a_message_list_prompt_is_kept_as_messages_with_a_canonical_id(tmp_path):
    row = verl_row("What is 1+1?", "2")
    out = load_verl(write_jsonl(tmp_path / "d.jsonl", [row]))
    assert out[0]["prompt"] == row["prompt"]
    assert out[0]["id"] == canonical_id(row["prompt"])
    # The same messages with their keys in another order are the same question.
    reordered = [{"content": m["content"], "role": m["role"]} for m in row["prompt"]]
    again = load_verl(write_jsonl(tmp_path / "e.jsonl", [{**row, "prompt": reordered}]))
    assert again[0]["id"] == out[0]["id"]


def test_text_prompt_ids_stay_the_text_id_of_the_prompt_next_to_message_prompts(tmp_path):
    messages = verl_row("What is 1+1?", "2")["prompt"]
    rows = [{"prompt": "What is 1+1?", "answer": "2"}, {"prompt": messages, "answer": "2"}]
    for drop in (False, True):
        out = load_rows(write_jsonl(tmp_path / "d.jsonl", rows), drop_system_prompt=drop)
        assert out[0]["prompt"] == "What is 1+1?" and out[0]["id"] == text_id("What is 1+1?")
        assert out[1]["id"] == canonical_id(out[1]["prompt"]) != out[0]["id"]


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], r"line 1: column 'prompt' is an empty list of messages"),
        (["hi"], r"line 1: column 'prompt' message 0 must be an object with 'role' and 'content', got str"),
        ([{"role": 1, "content": "hi"}], r"line 1: column 'prompt' message 0: 'role' must be text, got int"),
        ([{"content": "hi"}], r"line 1: column 'prompt' message 0 has no 'role'; its keys: \['content'\]"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            r"line 1: column 'prompt' message 0: 'content' must be text, got list",
        ),
        ([{"role": "user", "content": " "}], r"line 1: column 'prompt' has no text in any message"),
    ],
)
def test_a_malformed_message_list_names_file_row_column_and_message(tmp_path, prompt, message):
    with pytest.raises(ValueError, match=message):
        load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt, "answer": "1"}]))


def test_a_message_without_content_names_file_row_column_and_message_index(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user"}]
    rows = [
        {"prompt": [{"role": "user", "content": "q"}], "answer": "1"},
        {"prompt": messages, "answer": "2"},
    ]
    with pytest.raises(
        ValueError,
        match=r"d\.jsonl: line 2: column 'prompt' message 1 has no 'content'; its keys: \['role'\]",
    ):
        load_rows(write_jsonl(tmp_path / "d.jsonl", rows))
    # In parquet every message has every key, None where it had none: the same error.
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(
        ValueError,
        match=r"d\.parquet: row 2: column 'prompt' message 1 has no 'content'; its keys: \['role'\]",
    ):
        load_rows(path)


def test_drop_system_prompt_drops_only_the_leading_system_messages(tmp_path):
    system, user = {"role": "system", "content": "S"}, {"role": "user", "content": "U"}
    rows = [{"prompt": [system, system, user, system], "answer": "1"}, {"prompt": "text", "answer": "2"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    kept, dropped = load_rows(path), load_rows(path, drop_system_prompt=True)
    assert kept[0]["prompt"] == [system, system, user, system]
    assert dropped[0]["prompt"] == [user, system] and dropped[0]["id"] == canonical_id([user, system])
    assert dropped[1]["prompt"] == "text" and dropped[1]["id"] == text_id("text")
    with pytest.raises(
        ValueError, match=r"line 1: column 'prompt' holds only system messages, which drop_system_prompt=True"
    ):
        load_rows(
            write_jsonl(tmp_path / "e.jsonl", [{"prompt": [system], "answer": "1"}]), drop_system_prompt=True
        )


def test_questions_that_differ_only_in_their_system_prompt_are_one_once_it_is_dropped(tmp_path):
    rows = [verl_row("What is 1+1?", "2", system="A"), verl_row("What is 1+1?", "2", system="B")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    assert len(load_verl(path)) == 2
    with pytest.warns(UserWarning, match=r"dropped 1 rows .*: line 2 \(repeats line 1\)"):
        assert len(load_verl(path, drop_system_prompt=True)) == 1
    rows[1]["reward_model"]["ground_truth"] = "3"
    with pytest.raises(ValueError, match=r"line 1 and line 2 have the same prompt but different answers"):
        load_verl(write_jsonl(tmp_path / "e.jsonl", rows), drop_system_prompt=True)


def test_find_row_follows_dotted_paths_and_dropped_system_prompts(tmp_path):
    rows = [verl_row("What is 1+1?", "2"), verl_row("What is 2+2?", "4")]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    loaded = load_verl(path, drop_system_prompt=True)
    assert find_row(path, "prompt", loaded[1]["prompt"], drop_system_prompt=True) == "line 2"
    assert find_row(path, "prompt", loaded[1]["prompt"]) is None  # the file's prompt has its system message
    assert find_row(path, "reward_model.ground_truth", "4") == "line 2"
    assert find_row(path, "reward_model.missing", "4") is None


def test_an_evaluation_file_counts_its_repeated_rows_instead_of_dropping_them(tmp_path, recwarn):
    rows = [{"prompt": "1+1=", "answer": "2"}] * 3 + [{"prompt": "2+2=", "answer": "4"}]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_rows(path, count_repeats=True)
    assert [(row["prompt"], row["num_samples"]) for row in loaded] == [("1+1=", 3), ("2+2=", 1)]
    assert not [w for w in recwarn if "dropped" in str(w.message)]
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "num_samples": 4}) + "\n")
    with pytest.raises(ValueError, match=r"eval.jsonl: line 1: column 'num_samples' would be replaced"):
        load_rows(path, count_repeats=True)


def test_an_evaluation_file_keeps_a_problem_under_each_of_its_domains(tmp_path):
    rows = [
        {"prompt": "1+2=", "answer": "3", "source": "aime"},
        {"prompt": "1+2=", "answer": "3", "source": "aime"},
        {"prompt": "1+2=", "answer": "3", "source": "amc"},
        {"prompt": "5+5=", "answer": "10", "source": "amc"},
    ]
    path = write_jsonl(tmp_path / "test.jsonl", rows)
    with pytest.warns(UserWarning, match=r"1 problem\(s\) appear under several domains: line 1 \('aime'\), "
                      r"line 3 \('amc'\); each domain keeps its own"):  # fmt: skip
        loaded = load_rows(path, domain_column="source", count_repeats=True)
    counts = [(row["prompt"], row["domain"], row["num_samples"]) for row in loaded]
    assert counts == [("1+2=", "aime", 2), ("1+2=", "amc", 1), ("5+5=", "amc", 1)]
    with warnings.catch_warnings():  # a training file keeps merging repeats as before, without this warning
        warnings.simplefilter("ignore")
        assert len(load_rows(path, domain_column="source")) == 2


# Issue 37: columns the reward functions' own arguments would lose to, answers stored as floats, message
# prompts held as JSON text, and ids that depend on the question, not on the file's schema.


@pytest.mark.parametrize(
    "column", ["completions", "prompts", "completion_ids", "trainer_state", "question_id"]
)
def test_a_column_named_like_what_the_trainer_passes_is_an_error_naming_it(tmp_path, column):
    rows = [{"prompt": "10+3=", "answer": "13"}, {"prompt": "1+1=", "answer": "2", column: "13"}]
    with pytest.raises(ValueError, match=rf"d\.jsonl: line 2: column '{column}' has the name of .* rename"):
        load_rows(write_jsonl(tmp_path / "d.jsonl", rows))


def test_answers_stored_as_floats_read_as_integers_where_integral_with_a_warning(tmp_path):
    rows = [{"prompt": "a", "answer": 37.0}, {"prompt": "b", "answer": 0.5}, {"prompt": "c", "answer": "7"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)  # JSON keeps 37.0 a float, and mixes types
    said = r"'answer' holds 2 answer\(s\) as floats, .*: line 1: 37\.0 -> '37'; line 2: 0\.5 -> '0\.5'; store"
    with pytest.warns(UserWarning, match=said):
        loaded = load_rows(path)
    assert [row["answer"] for row in loaded] == ["37", "0.5", "7"]


def test_a_missing_answer_in_a_float_column_is_an_error_naming_the_row(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"prompt": ["a", "b"], "answer": pa.array([37.0, float("nan")], pa.float64())})
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=r"d\.parquet: row 2: column 'answer' is nan \(a missing value\?\)"):
        load_rows(path)
    path = tmp_path / "d.json"
    path.write_text('[{"prompt": "a", "answer": NaN}]')  # what json.dumps writes for a float NaN
    with pytest.raises(ValueError, match=r"d\.json: row 1: column 'answer' is nan"):
        load_rows(path)


def test_messages_held_as_json_text_are_messages(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    rows = [
        {"prompt": json.dumps(messages), "answer": "2"},
        {"prompt": "[1, 2] + [3]?", "answer": "[1, 2, 3]"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    first, second = load_rows(path, drop_system_prompt=True)
    assert first["prompt"] == messages[1:] and first["id"] == canonical_id(messages[1:])
    assert second["prompt"] == "[1, 2] + [3]?"  # text that is no list of messages stays text
    assert find_row(path, "prompt", messages[1:], drop_system_prompt=True) == "line 1"
    assert load_rows(path)[0]["prompt"] == messages


def test_a_key_added_to_one_message_of_a_parquet_file_changes_no_other_question_id(tmp_path):
    rows = [verl_row("What is 1+1?", "2"), verl_row("What is 2+2?", "4")]
    before = tmp_path / "before.parquet"
    pq.write_table(pa.Table.from_pylist(rows), before)
    rows[1]["prompt"][1]["name"] = "alice"  # parquet gives every other message name=None
    after = tmp_path / "after.parquet"
    pq.write_table(pa.Table.from_pylist(rows), after)
    old, new = load_verl(before), load_verl(after)
    assert new[0]["id"] == old[0]["id"] == canonical_id(rows[0]["prompt"])
    assert new[0]["prompt"] == rows[0]["prompt"]  # no None keys reach a chat template
    assert new[1]["prompt"][1] == {"role": "user", "content": "What is 2+2?", "name": "alice"}
    assert find_row(after, "prompt", new[0]["prompt"]) == "row 1"

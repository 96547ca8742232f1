"""Reads prompt/answer datasets from disk into validated, normalized rows (the files' raw rows come from
`exgrpo_pl.data.files`, a row's values and prompt from `exgrpo_pl.data.fields`).

Formats, by path: `.jsonl` (one object per line), `.json` (a list of objects), `.parquet`, or a directory
written by `datasets.Dataset.save_to_disk` (needs the `datasets` extra). Every row comes out as
`{"id": int, "prompt": str or list of messages, "answer": str, "domain": str (if a domain column is named),
<other columns>}`. A bad row stops loading with an error naming the file, the row and the column; a `.jsonl`
or `.json` file must be UTF-8 (a leading byte-order mark is allowed), and a byte that is not is an error
naming the line and the byte offset.

Columns are named by their name or, inside nested objects, by a dotted path: `reward_model.ground_truth` is
the `ground_truth` key of the `reward_model` column (a column whose own name holds the dot is found first).
A path a row lacks is an error naming the row, the path and the keys present where it broke. The column a
path reads inside stays in the row whole, so reward functions get it as a keyword column.

A prompt is text, or a list of chat messages `[{"role": "system", "content": ...}, {"role": "user",
"content": ...}]` (TRL's "conversational" format), kept as that list: the collector renders it with the
tokenizer's chat template, and the reward functions receive it, and their completions, as messages.
`drop_system_prompt` drops its leading system messages, as the paper's evaluation does.

Duplicates: real datasets repeat questions (OpenR1-Math and MATH do). A row that repeats an earlier row's
question (its prompt, or its id when `id_column` is given) with the same answer is dropped, with one warning
per file that counts them and names the first few; a repeat with a different answer (or, with `id_column`, a
different prompt) is an error naming both rows, since either reference answer could be the wrong one.

Common math layouts and the arguments that read them:

- prompt/answer (the default): `prompt_column="prompt", answer_column="answer"`.
- problem/solution, e.g. MATH, where the solution is worked text ending in `\\boxed{...}`:
  `prompt_column="problem", answer_column="solution", answer_from="boxed"`; the answer is the content of
  the solution's last box.
- OpenR1-Math (`problem`, `solution`, `answer`, `uuid`, ...): `prompt_column="problem",
  answer_column="answer"`; `solution` and the other columns stay in each row, so reward functions get them
  as keyword columns.
- verl, the official code (`data_source`, `prompt` as messages, `ability`, `reward_model: {ground_truth,
  style}`, `extra_info`): `prompt_column="prompt", answer_column="reward_model.ground_truth",
  domain_column="data_source"`, and `drop_system_prompt=True` to leave out its system prompt.
"""

from __future__ import annotations

import warnings
import zlib
from pathlib import Path
from typing import Any

from exgrpo_pl.batch import text_id
from exgrpo_pl.data.fields import (
    answer_text,
    as_messages,
    lookup,
    prompt_key,
    prompt_value,
    text_value,
    walk,
    without_system,
)
from exgrpo_pl.data.files import read_raw_rows
from exgrpo_pl.rewards.math_verify import extract_boxed
from exgrpo_pl.rewards.protocol import REWARD_KEYWORDS

_INT64 = (-(2**63), 2**63 - 1)

RESERVED_COLUMNS = (*REWARD_KEYWORDS, "question_id")
"""Column names a dataset may not use: the arguments reward functions get from the trainer (a column would
replace one in every reward call; `exgrpo_pl.rewards.REWARD_KEYWORDS` lists them) and the batch key
of the question ids."""

ANSWER_FROM = ("column", "boxed")
"""The allowed values of `answer_from`: the answer column as it is, or the content of its last box."""


def check_answer_from(answer_from: str) -> None:
    """Raises ValueError unless `answer_from` is one of `ANSWER_FROM`."""
    if answer_from not in ANSWER_FROM:
        allowed = ", ".join(repr(value) for value in ANSWER_FROM)
        raise ValueError(f"answer_from must be one of {allowed}, got {answer_from!r}")


def _boxed_answer(text: str, where: str, column: str) -> str:
    answer = extract_boxed(text)
    if answer is None:
        raise ValueError(
            f"{where}: column {column!r} has no complete \\boxed{{...}} to take the answer from "
            f"(answer_from='boxed'): {text[-200:]!r}"
        )
    if not answer.strip():
        raise ValueError(f"{where}: the last \\boxed{{}} in column {column!r} is empty")
    return answer.strip()


def _question_id(value: Any, where: str, column: str) -> tuple[int, int | str]:
    """`(id, key)`: the id, and the value it comes from (an int, or a string that was hashed)."""
    # Integer ids are used as they are; other string ids are hashed to an int the way prompts are.
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, str):
        return text_id(value), value
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: column {column!r} must be an int or a string, got {type(value).__name__}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{where}: column {column!r} value {value} does not fit in int64")
    return value, value


def load_rows(
    path: str | Path,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    id_column: str | None = None,
    domain_column: str | None = None,
    answer_from: str = "column",
    drop_system_prompt: bool = False,
    count_repeats: bool = False,
) -> list[dict[str, Any]]:
    """Loads and validates a prompt/answer dataset.

    See the module docstring for the arguments that read the common math layouts (prompt/answer,
    problem/solution, OpenR1-Math, verl). Every `*_column` is a column name or a dotted path into nested
    objects (`"reward_model.ground_truth"`).

    Args:
        path: a `.jsonl`, `.json` or `.parquet` file, or a `datasets.Dataset.save_to_disk` directory.
        prompt_column: column holding the prompt: text, or a list of chat messages (dicts with a string
            `role` and `content`; or JSON text of such a list), kept as that list without the keys valued
            None; becomes `prompt`.
        answer_column: column holding the reference answer (numbers become text, a float that is an integer
            that integer, with a warning naming the float rows); becomes `answer`.
        id_column: column holding a stable question id (an int, or a string, hashed with `text_id` unless
            it is a decimal integer); becomes `id`. None: `id` is the `text_id` of the prompt (of a canonical
            JSON of its messages, keys sorted, None-valued keys left out), which stays the same across runs,
            row orders and keys added to other rows' messages.
        domain_column: column holding the task/domain name (verl's `data_source`); becomes `domain`.
        answer_from: "column" takes the answer column as it is; "boxed" reads it as a worked solution
            (e.g. MATH's `solution`) and takes the content of its last `\\boxed{...}`, nested braces kept.
        drop_system_prompt: drop the leading `system` messages of a message-list prompt (before its id is
            computed); text prompts are unchanged.
        count_repeats: for an evaluation file, which repeats a problem once per sample it is scored on (the
            paper's test file holds each AIME and AMC problem 32 times): a repeated row is counted instead
            of dropped, and every row gets `num_samples`, the number of rows of its question. A question is
            one per domain: a problem under two domains (benchmarks) is kept once in each, with its own count,
            and a warning names the rows.

    Returns:
        The rows in file order, each question once. Columns not named above keep their names and values.
            A row that repeats an earlier row's question (the same prompt; with `id_column`, the same id) and
            answer is dropped, the earlier row and its other columns kept, with one warning for the file that
            counts the dropped rows and names the first few (`count_repeats` counts them instead).

    Raises:
        ValueError: on a line that is not UTF-8 or not JSON, a missing column or dotted path, an empty prompt
            or answer, a message that is not a dict with a string role and content, an empty list of
            messages (or one left empty by `drop_system_prompt`), a repeated prompt with a different answer,
            a repeated id with a different prompt or answer, two different prompts or ids whose hashed ids
            collide, a column whose name clashes with a normalized key or is one of `RESERVED_COLUMNS`, a NaN
            or infinite answer, an unknown `answer_from`, a solution without a complete `\\boxed{...}` (or
            with an empty one) when `answer_from="boxed"`, or no rows at all.
        FileNotFoundError: if `path` does not exist.
    """
    check_answer_from(answer_from)
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    sources = {"prompt": prompt_column, "answer": answer_column, "id": id_column, "domain": domain_column}
    required = [column for column in sources.values() if column is not None]
    rows: list[dict[str, Any]] = []
    # key -> (position, question, row); the key is the id, and in an evaluation file (id, domain): a problem
    # that two benchmarks of the file share is a problem of each.
    first_seen: dict[Any, tuple[str, int | str, dict[str, Any]]] = {}
    repeats: list[tuple[str, str]] = []  # (position dropped, position of the row it repeats)
    samples: dict[Any, int] = {}  # key -> rows of that question
    floats: list[str] = []  # "line 3: 37.0 -> '37'" for each answer given as a float
    domains_of: dict[int, dict[str, str]] = {}  # id -> {domain: position of its first row}, evaluation files
    for position, raw in read_raw_rows(path):
        where = f"{path}: {position}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected an object with columns, got {type(raw).__name__}")
        values = {key: lookup(raw, source, where) for key, source in sources.items() if source is not None}
        for key, source in sources.items():
            # A column named like a normalized key but not its source would be silently overwritten.
            if key in raw and source is not None and source != key:
                raise ValueError(
                    f"{where}: column {key!r} would be replaced by column {source!r}; rename one of them"
                )
        if id_column is None and "id" in raw:
            raise ValueError(f"{where}: has an 'id' column; pass id_column='id' to use it (or drop it)")
        if count_repeats and "num_samples" in raw:
            raise ValueError(f"{where}: column 'num_samples' would be replaced by the count of its repeats")
        # A column read by its name is renamed; one a dotted path reads inside stays, whole.
        row = {key: value for key, value in raw.items() if key not in required}
        for key in row:
            if key in RESERVED_COLUMNS:
                what = (
                    "the question ids' batch key" if key == "question_id" else "an argument reward functions"
                )
                raise ValueError(
                    f"{where}: column {key!r} has the name of {what} get from the trainer, which it would"
                    f" replace (reserved: {', '.join(RESERVED_COLUMNS)}); rename the column"
                )
        row["prompt"] = prompt_value(values["prompt"], where, prompt_column, drop_system_prompt)
        row["answer"] = answer_text(values["answer"], where, answer_column)
        if isinstance(values["answer"], float):
            floats.append(f"{position}: {values['answer']!r} -> {row['answer']!r}")
        if answer_from == "boxed":
            row["answer"] = _boxed_answer(row["answer"], where, answer_column)
        # `question` identifies the question: its prompt, or its id as written (before any hashing).
        if id_column is None:
            question = prompt_key(row["prompt"])
            row["id"] = text_id(question)
        else:
            row["id"], question = _question_id(values["id"], where, id_column)
        if domain_column is not None:
            row["domain"] = text_value(values["domain"], where, domain_column)
        key = (row["id"], row.get("domain")) if count_repeats else row["id"]
        if key in first_seen:
            earlier, earlier_question, earlier_row = first_seen[key]
            _check_repeat(
                path, (earlier, position), (earlier_question, question), (earlier_row, row), id_column
            )
            repeats.append((position, earlier))
            samples[key] += 1
            continue
        if count_repeats:
            domains_of.setdefault(row["id"], {})[row.get("domain")] = position
        first_seen[key] = (position, question, row)
        samples[key] = 1
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    if floats:
        more = f" and {len(floats) - 5} more" if len(floats) > 5 else ""
        warnings.warn(
            f"{path}: column {answer_column!r} holds {len(floats)} answer(s) as floats, read as integers"
            f" where integral and as Python prints them otherwise: {'; '.join(floats[:5])}{more}; store the"
            " answers as text to say exactly how each reads",
            stacklevel=2,
        )
    if count_repeats:
        for row in rows:
            row["num_samples"] = samples[(row["id"], row.get("domain"))]
        _warn_shared_problems(path, domains_of)
    elif repeats:
        named = ", ".join(f"{dropped} (repeats {kept})" for dropped, kept in repeats[:5])
        more = f" and {len(repeats) - 5} more" if len(repeats) > 5 else ""
        key = "prompt" if id_column is None else f"{id_column!r}, prompt"
        warnings.warn(
            f"{path}: dropped {len(repeats)} rows that repeat an earlier row's {key} and answer: "
            f"{named}{more}; each question is kept once",
            stacklevel=2,
        )
    return rows


def _warn_shared_problems(path: Path, domains_of: dict[int, dict[str, str]]) -> None:
    """Warns, naming the first few, about problems an evaluation file holds under several domains: each domain
    keeps its own (sampled and reported as one of its problems), which a reader of the per-domain counts
    should know."""
    shared = [positions for positions in domains_of.values() if len(positions) > 1]
    if not shared:
        return
    named = "; ".join(
        ", ".join(f"{position} ({domain!r})" for domain, position in positions.items())
        for positions in shared[:5]
    )
    more = f" and {len(shared) - 5} more" if len(shared) > 5 else ""
    warnings.warn(
        f"{path}: {len(shared)} problem(s) appear under several domains: {named}{more}; each domain keeps its"
        " own, sampled and reported with that domain's problems",
        stacklevel=3,
    )


def find_row(path: str | Path, column: str, value: Any, drop_system_prompt: bool = False) -> str | None:
    """Where in `path` the first row whose `column` equals `value` is ("line 3", "row 3"), or None.

    Reads the file again: for error messages about a row after loading, which rows do not carry.

    Args:
        path: the file, as given to `load_rows`.
        column: a column name or a dotted path, as given to `load_rows`.
        value: the loaded row's value, e.g. its `prompt`.
        drop_system_prompt: compare a message list without its leading system messages, as `load_rows`
            keeps it with the same option.
    """
    path = Path(path).expanduser()
    for position, raw in read_raw_rows(path):
        if not isinstance(raw, dict):
            continue
        found, missing = walk(raw, column)
        found = as_messages(found)
        if drop_system_prompt and isinstance(found, list):
            found = without_system(found)
        if missing is None and found == value:
            return position
    return None


def _check_repeat(
    path: Path,
    positions: tuple[str, str],
    questions: tuple[int | str, int | str],
    rows: tuple[dict[str, Any], dict[str, Any]],
    id_column: str | None,
) -> None:
    """Raises ValueError unless two rows with the same id are the same question with the same answer.

    Args:
        path: the file, for the message.
        positions: where the earlier and the later row are in the file.
        questions: what identifies each row's question (its prompt, or its `id_column` value).
        rows: the two normalized rows.
        id_column: the id column, or None when ids are hashed prompts.
    """
    (first, second), (a, b) = positions, rows
    if questions[0] != questions[1]:
        what = "prompts" if id_column is None else f"{id_column!r} values"
        raise ValueError(
            f"{path}: {first} and {second} have different {what} whose 63-bit hashed ids collide "
            f"({a['id']}): "
            f"{_short(questions[0])} and {_short(questions[1])}; "
            + (
                "give the rows integer ids in a column named by id_column"
                if id_column is None
                else "use integer ids"
            )
        )
    same = f"the same {'prompt' if id_column is None else f'{id_column!r} ({questions[0]})'}"
    if a["prompt"] != b["prompt"]:
        raise ValueError(
            f"{path}: {first} and {second} have {same} but different prompts: {_short(a['prompt'])} and "
            f"{_short(b['prompt'])}; give them different ids, or drop one"
        )
    if a["answer"] != b["answer"]:
        hint = "drop one or fix its answer" + (
            ", or give the rows ids with id_column" if id_column is None else ""
        )
        raise ValueError(
            f"{path}: {first} and {second} have {same} but different answers: {_short(a['answer'])} and "
            f"{_short(b['answer'])}; a question takes one reference answer: {hint}"
        )


def _short(value: Any) -> str:
    """`value`'s repr, cut to about 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def split_rows(
    rows: list[dict[str, Any]], val_fraction: float, seed: int = 0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Deterministic, disjoint train/validation split, stratified by `domain`.

    Which rows go to validation depends only on their ids, the seed and the fraction, not on row order.

    Args:
        rows: rows with an `id` and optionally a `domain`.
        val_fraction: share of each domain that goes to validation, in [0, 1).
        seed: changes which rows are picked.

    Returns:
        `(train_rows, val_rows)`, each in the input order.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    by_domain: dict[Any, list[int]] = {}
    for index, row in enumerate(rows):
        by_domain.setdefault(row.get("domain"), []).append(index)
    val: set[int] = set()
    for indices in by_domain.values():
        ranked = sorted(
            indices, key=lambda i: (zlib.crc32(f"{seed}:{rows[i]['id']}".encode()), rows[i]["id"])
        )
        val.update(ranked[: round(val_fraction * len(indices))])
    train_rows = [row for index, row in enumerate(rows) if index not in val]
    val_rows = [row for index, row in enumerate(rows) if index in val]
    return train_rows, val_rows

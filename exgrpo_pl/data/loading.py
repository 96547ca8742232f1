"""Reads prompt/answer datasets from disk into validated, normalized rows.

Formats, by path: `.jsonl` (one object per line), `.json` (a list of objects), `.parquet`, or a directory
written by `datasets.Dataset.save_to_disk` (needs the `datasets` extra). Every row comes out as
`{"id": int, "prompt": str, "answer": str, "domain": str (if a domain column is named), <other columns>}`.
A bad row stops loading with an error naming the file, the row and the column.

Common math layouts and the arguments that read them:

- prompt/answer (the default): `prompt_column="prompt", answer_column="answer"`.
- problem/solution, e.g. MATH, where the solution is worked text ending in `\\boxed{...}`:
  `prompt_column="problem", answer_column="solution", answer_from="boxed"`; the answer is the content of
  the solution's last box.
- OpenR1-Math (`problem`, `solution`, `answer`, `uuid`, ...): `prompt_column="problem",
  answer_column="answer"`; `solution` and the other columns stay in each row, so reward functions get them
  as keyword columns.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from exgrpo_pl.rewards.math_verify import extract_boxed

_INT64 = (-(2**63), 2**63 - 1)

ANSWER_FROM = ("column", "boxed")
"""The allowed values of `answer_from`: the answer column as it is, or the content of its last box."""


def check_answer_from(answer_from: str) -> None:
    """Raises ValueError unless `answer_from` is one of `ANSWER_FROM`."""
    if answer_from not in ANSWER_FROM:
        allowed = ", ".join(repr(value) for value in ANSWER_FROM)
        raise ValueError(f"answer_from must be one of {allowed}, got {answer_from!r}")


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {line_number}", json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{line_number}: malformed JSON: {err.msg} (column {err.colno})"
                ) from err


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: malformed JSON: {err.msg} (column {err.colno})") from err
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of row objects, got {type(data).__name__}")
    for number, row in enumerate(data, start=1):
        yield f"row {number}", row


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield f"row {number}", row


def _read_saved_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError(
            f"{path}: reading a saved dataset needs `pip install 'exgrpo-pl[datasets]'`"
        ) from err
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        raise ValueError(
            f"{path}: holds several splits ({', '.join(dataset)}); point at one of them, e.g. {path}/train"
        )
    for number, row in enumerate(dataset, start=1):
        yield f"row {number}", row


def _read(path: Path) -> Iterator[tuple[str, Any]]:
    if path.is_dir():
        return _read_saved_dataset(path)
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    if path.suffix not in readers:
        raise ValueError(
            f"{path}: unsupported file type; expected .jsonl, .json, .parquet or a saved dataset directory"
        )
    return readers[path.suffix](path)


def _text(value: Any, where: str, column: str) -> str:
    # Numbers are fine as answers (JSON and parquet keep "42" as an int); containers and None are not.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {column!r} must be text, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: column {column!r} is empty")
    return value


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


def _question_id(value: Any, where: str, column: str) -> int:
    # Integer ids are used as they are; other string ids are hashed to an int the way prompts are.
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, str):
        return zlib.crc32(value.encode("utf-8"))
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: column {column!r} must be an int or a string, got {type(value).__name__}")
    if not _INT64[0] <= value <= _INT64[1]:
        raise ValueError(f"{where}: column {column!r} value {value} does not fit in int64")
    return value


def load_rows(
    path: str | Path,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    id_column: str | None = None,
    domain_column: str | None = None,
    answer_from: str = "column",
) -> list[dict[str, Any]]:
    """Loads and validates a prompt/answer dataset.

    See the module docstring for the arguments that read the common math layouts (prompt/answer,
    problem/solution, OpenR1-Math).

    Args:
        path: a `.jsonl`, `.json` or `.parquet` file, or a `datasets.Dataset.save_to_disk` directory.
        prompt_column: column holding the prompt text; becomes `prompt`.
        answer_column: column holding the reference answer (numbers become strings); becomes `answer`.
        id_column: column holding a stable question id (an int, or a string, hashed with CRC-32 unless it
            is a decimal integer); becomes `id`. None: `id` is the CRC-32 of the prompt text, which stays
            the same across runs and row orders.
        domain_column: column holding the task/domain name; becomes `domain`.
        answer_from: "column" takes the answer column as it is; "boxed" reads it as a worked solution
            (e.g. MATH's `solution`) and takes the content of its last `\\boxed{...}`, nested braces kept.

    Returns:
        The rows in file order. Columns not named above keep their names and values.

    Raises:
        ValueError: on a malformed line, a missing column, an empty prompt or answer, two rows with the
            same id, a column whose name clashes with a normalized key, an unknown `answer_from`, a
            solution without a complete `\\boxed{...}` (or with an empty one) when `answer_from="boxed"`,
            or no rows at all.
        FileNotFoundError: if `path` does not exist.
    """
    check_answer_from(answer_from)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    sources = {"prompt": prompt_column, "answer": answer_column, "id": id_column, "domain": domain_column}
    required = [column for column in sources.values() if column is not None]
    rows: list[dict[str, Any]] = []
    first_seen: dict[int, str] = {}
    for position, raw in _read(path):
        where = f"{path}: {position}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected an object with columns, got {type(raw).__name__}")
        for column in required:
            if column not in raw:
                raise ValueError(f"{where}: missing column {column!r}; columns present: {sorted(raw)}")
        for key, source in sources.items():
            # A column named like a normalized key but not its source would be silently overwritten.
            if key in raw and source is not None and source != key:
                raise ValueError(
                    f"{where}: column {key!r} would be replaced by column {source!r}; rename one of them"
                )
        if id_column is None and "id" in raw:
            raise ValueError(f"{where}: has an 'id' column; pass id_column='id' to use it (or drop it)")
        row = {key: value for key, value in raw.items() if key not in required}
        row["prompt"] = _text(raw[prompt_column], where, prompt_column)
        row["answer"] = _text(raw[answer_column], where, answer_column)
        if answer_from == "boxed":
            row["answer"] = _boxed_answer(row["answer"], where, answer_column)
        if id_column is None:
            row["id"] = zlib.crc32(row["prompt"].encode("utf-8"))
        else:
            row["id"] = _question_id(raw[id_column], where, id_column)
        if domain_column is not None:
            row["domain"] = _text(raw[domain_column], where, domain_column)
        if row["id"] in first_seen:
            cause = "identical prompts" if id_column is None else f"same {id_column!r}"
            raise ValueError(
                f"{path}: {first_seen[row['id']]} and {position} have the same id {row['id']} ({cause})"
            )
        first_seen[row["id"]] = position
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


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

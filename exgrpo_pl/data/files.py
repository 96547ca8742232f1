"""Reading a data file's raw rows, each with where it is: `.jsonl` (one object per line), `.json` (a list of
objects), `.parquet`, or a directory written by `datasets.Dataset.save_to_disk` (the `datasets` extra). A
`.jsonl` or `.json` file must be UTF-8 (a leading byte-order mark is allowed); a byte that is not is an error
naming the line and the byte offset. Used by `exgrpo_pl.data.loading`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _decode(data: bytes, path: Path, first_line: int = 1, offset: int = 0) -> str:
    """`data`, the part of `path` from line `first_line` and byte `offset` on, decoded as UTF-8, BOM dropped.

    Raises:
        ValueError: naming the file, the line and the byte offset of the first byte that is not UTF-8.
    """
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as err:
        line_number = first_line + data.count(b"\n", 0, err.start)
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ValueError(
            f"{path}:{line_number}: not UTF-8: byte 0x{data[err.start]:02x} at byte offset "
            f"{offset + err.start} (byte {column} of the line); save the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 {path.name} > {path.stem}.utf8{path.suffix}` for a Latin-1 file"
        ) from err


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    # Bytes, decoded line by line, so that an error can say which line and at which byte offset.
    offset = 0
    with path.open("rb") as handle:
        for line_number, data in enumerate(handle, start=1):
            line = _decode(data, path, line_number, offset)
            offset += len(data)
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
        data = json.loads(_decode(path.read_bytes(), path))
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


def read_raw_rows(path: Path) -> Iterator[tuple[str, Any]]:
    if path.is_dir():
        return _read_saved_dataset(path)
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    if path.suffix not in readers:
        raise ValueError(
            f"{path}: unsupported file type; expected .jsonl, .json, .parquet or a saved dataset directory"
        )
    return readers[path.suffix](path)

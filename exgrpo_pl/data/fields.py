"""A row's values by column name or dotted path (`reward_model.ground_truth`), and its prompt: text, or a
list of chat messages checked message by message (also when the column holds them as a JSON string), with
its leading system messages dropped on request. Errors name the row (`where`), the column and what is wrong.
Used by `exgrpo_pl.data.loading`.
"""

from __future__ import annotations

import json
import math
import unicodedata
from typing import Any


def number_text(value: int | float, where: str, column: str) -> str:
    """A number as text: an int as written, an integral float as that integer (`37.0` -> "37", as an answer
    37 reads; a float column is how pandas stores integers next to a missing value), another float as Python
    prints it (`0.5` -> "0.5").

    Raises:
        ValueError: on NaN or an infinity (a missing value, in a float column), naming the row and the column.
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(
                f"{where}: column {column!r} is {value} (a missing value?); give the row a value or drop it"
            )
        if value.is_integer():
            return str(int(value))
    return str(value)


def text_value(value: Any, where: str, column: str) -> str:
    # Numbers are fine as answers (JSON and parquet keep "42" as an int); containers and None are not.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = number_text(value, where, column)
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {column!r} must be text, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{where}: column {column!r} is empty")
    return value


def answer_text(value: Any, where: str, column: str) -> str:
    """An answer as text (`text_value`), refusing control characters other than tab and line breaks: a NUL or
    an escape byte never matches what a model writes, and would surface only when a reward reads it, steps
    into training, naming a row of a batch instead of the file's line.

    Raises:
        ValueError: naming the row, the column and the characters.
    """
    text = text_value(value, where, column)
    control = sorted({char for char in text if unicodedata.category(char) == "Cc" and char not in "\t\n\r"})
    if control:
        raise ValueError(
            f"{where}: column {column!r} holds control character(s) {', '.join(map(repr, control))}: "
            f"{text!r}; remove them from the data"
        )
    return text


def walk(raw: dict[str, Any], path: str) -> tuple[Any, int | None]:
    """Follows column name or dotted `path` in `raw`.

    Returns:
        `(value, None)` when found: the column named `path` if there is one, else the value reached key by
            key through nested objects; otherwise `(the value where it broke, the index of the key missing)`.
    """
    if path in raw:
        return raw[path], None
    value: Any = raw
    for depth, key in enumerate(path.split(".")):
        if not isinstance(value, dict) or key not in value:
            return value, depth
        value = value[key]
    return value, None


def lookup(raw: dict[str, Any], path: str, where: str) -> Any:
    """The value of column `path` (a name, or a dotted path into nested objects) in the row `raw`.

    Raises:
        ValueError: naming `where`, the path, and the keys (or the value) present where the path broke.
    """
    value, depth = walk(raw, path)
    if depth is None:
        return value
    if depth == 0:
        raise ValueError(f"{where}: missing column {path!r}; columns present: {sorted(raw)}")
    reached = ".".join(path.split(".")[:depth])
    if not isinstance(value, dict):
        kind = type(value).__name__
        raise ValueError(f"{where}: missing column {path!r}: {reached!r} is {kind}, not an object with keys")
    missing = path.split(".")[depth]
    raise ValueError(
        f"{where}: missing column {path!r}: {reached!r} has no key {missing!r}; its keys: {sorted(value)}"
    )


def as_messages(value: Any) -> Any:
    """A prompt value as chat messages where it holds them: a list's dict entries without their keys valued
    None (a parquet file gives every message the keys of all of them, None where a message has none: they
    are not part of the question, and must not reach a chat template), and text that is a JSON list of
    messages (objects with a "role") parsed into that list. Anything else is returned as it is."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        if not (
            parsed and isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed)
        ):
            return value
        value = parsed
    if not isinstance(value, list):
        return value
    return [
        {key: field for key, field in message.items() if field is not None}
        if isinstance(message, dict)
        else message
        for message in value
    ]


def checked_messages(value: list[Any], where: str, column: str) -> list[dict[str, Any]]:
    """`value` when it is a non-empty list of chat messages, each a dict with a string role and content."""
    if not value:
        raise ValueError(f"{where}: column {column!r} is an empty list of messages")
    for index, message in enumerate(value):
        at = f"{where}: column {column!r} message {index}"
        if not isinstance(message, dict):
            raise ValueError(
                f"{at} must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if message.get(key) is None:
                present = sorted(name for name, field in message.items() if field is not None)
                raise ValueError(f"{at} has no {key!r}; its keys: {present}")
            if not isinstance(message[key], str):
                raise ValueError(f"{at}: {key!r} must be text, got {type(message[key]).__name__}")
    return value


def without_system(messages: list[Any]) -> list[Any]:
    """`messages` without their leading system messages."""
    for start, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") != "system":
            return messages[start:]
    return []


def prompt_value(value: Any, where: str, column: str, drop_system_prompt: bool) -> str | list[dict[str, Any]]:
    """A row's prompt: text, or a list of chat messages (`as_messages`; leading system ones dropped if
    asked)."""
    value = as_messages(value)
    if not isinstance(value, list):
        return text_value(value, where, column)
    messages = checked_messages(value, where, column)
    if drop_system_prompt:
        messages = without_system(messages)
        if not messages:
            raise ValueError(
                f"{where}: column {column!r} holds only system messages, which drop_system_prompt=True drops"
            )
    if not any(message["content"].strip() for message in messages):
        raise ValueError(f"{where}: column {column!r} has no text in any message")
    return messages


def prompt_key(prompt: str | list[dict[str, Any]]) -> str:
    """What identifies a prompt: its text, or a canonical JSON of its messages (keys sorted, no spaces), so
    that equal message lists give the same key whatever their key order."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))

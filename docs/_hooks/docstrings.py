"""MkDocs hook: docstrings that the API reference would render otherwise than as written fail the build.

mkdocstrings reads Google-style sections with griffe, which takes each line at an item's indentation for a
new item: a `Returns:` description whose second line is not indented further renders as two rows (and a
backticked value split over them shows its backticks). Griffe's own complaints (a documented parameter
the signature lacks, a `Raises:` line without an exception) only reach its log. This loads the package as
the API pages do and logs each problem as a warning, so `mkdocs build --strict` stops on it;
tests/test_docs.py runs the same check.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import griffe

sys.path.insert(0, str(Path(__file__).parent))
from griffe_callbacks import CallbacksPackage  # noqa: E402

ROOT = Path(__file__).parents[2]
log = logging.getLogger("mkdocs.plugins.exgrpo_docstrings")


def problems() -> list[str]:
    """Each docstring of `exgrpo_pl` (callbacks included) that griffe cannot read as written."""
    found: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append(record.getMessage())

    handler = Collect(logging.WARNING)
    griffe_log = logging.getLogger("griffe")
    griffe_log.addHandler(handler)
    propagate, griffe_log.propagate = griffe_log.propagate, False  # each problem reported once, below
    try:
        package = griffe.load(
            "exgrpo_pl",
            search_paths=[str(ROOT)],
            docstring_parser="google",
            docstring_options={"warn_missing_types": False},  # as mkdocs.yml: types come from signatures
            extensions=griffe.load_extensions(CallbacksPackage),
            resolve_aliases=False,
        )
        for obj in _documented(package):
            for section in obj.docstring.parsed:  # parsing is what logs griffe's complaints
                if section.kind.value == "returns" and len(section.value) > 1:
                    found.append(
                        f"{obj.relative_filepath}:{obj.docstring.lineno}: {obj.path}: its Returns reads as "
                        f"{len(section.value)} values; indent the description's later lines further"
                    )
    finally:
        griffe_log.removeHandler(handler)
        griffe_log.propagate = propagate
    return found


def _documented(obj: griffe.Object):
    for member in obj.members.values():
        if member.is_alias:
            continue
        if member.docstring:
            yield member
        if member.is_module or member.is_class:
            yield from _documented(member)


def on_pre_build(config, **kwargs) -> None:
    for problem in problems():
        log.warning(problem)

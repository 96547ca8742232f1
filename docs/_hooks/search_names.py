"""MkDocs hook: the site's search finds a class name typed in any case (`replaycallback`, `ReplayCallback`).

Material's search splits words at camel-case humps (mkdocs.yml's `separator`), so that `Callback` finds
`ReplayCallback`; but a query typed in lower case has no humps and stays one word, `replaycallback`, which
no indexed word equals. After the search plugin writes its index, this adds to each entry a `names` field
(searched, boosted in mkdocs.yml, never shown): every camel-case word of its title and text, lower-cased
whole.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mkdocs.plugins import event_priority

CAMEL_CASE = re.compile(r"\b[A-Za-z][A-Za-z0-9]*[a-z0-9][A-Z][A-Za-z0-9]*\b|\b[A-Z]{2,}[a-z][A-Za-z0-9]*\b")


def names(text: str) -> str:
    """The camel-case words of `text`, lower-cased, each once, in order."""
    return " ".join(dict.fromkeys(word.lower() for word in CAMEL_CASE.findall(text)))


def add_names(index: dict) -> dict:
    for entry in index["docs"]:
        found = names(f"{entry['title']} {entry['text']}")
        if found:
            entry["names"] = found
    return index


@event_priority(-100)  # after the search plugin has written the index
def on_post_build(config, **kwargs) -> None:
    path = Path(config["site_dir"]) / "search" / "search_index.json"
    if path.exists():
        path.write_text(json.dumps(add_names(json.loads(path.read_text())), separators=(",", ":")))

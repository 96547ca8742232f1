"""MkDocs hook: every table fits its page's column in a 1280-pixel-wide browser, or the build fails.

Material draws a table wider than its column inside a scroll box, so its last columns are hidden until the
reader scrolls sideways, and a code span that cannot wrap (a test id) is cut at the box's edge. A browser
gives a table at least its min-content width: per column, the widest cell's longest piece that cannot wrap,
plus the cell's padding. This computes that width from the built HTML with the advance widths of the font a
browser falls back to (`REGULAR`, `BOLD`, in em) and the sizes `docs/stylesheets/extra.css` sets (read from
it), and logs a warning, which `mkdocs build --strict` turns into a failure, for each table wider than the
column (`column_width`: the window less the sidebars the page shows and the content's margins).

Code spans in tables get a `<wbr>` after each `/`, `.`, `_` and `::`, so a path or a test id wraps between
its parts instead of being cut (a browser breaks after `-` by itself; the stylesheet keeps a code span from
breaking anywhere else).
"""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.exgrpo_tables")

WINDOW = 1280  # px: the browser width the pages are checked at
ROOT_FONT = 20  # px: Material's root font size below 1600 px (125%)
SIDEBAR = 12.1 * ROOT_FONT  # each of Material's two sidebars, shown from 1220 px (navigation) and 960 (toc)
# The rest of the window a table cannot use: the content's margins and the table's padding, less the scroll
# box's negative margins, and a 15 px scrollbar (measured in Chromium at 1280 px: a table 718 px wide fits).
MARGINS = 78
# Advance widths in em of DejaVu Sans (regular for cells, bold for headers), the font a browser falls back to
# where Material's web font (Roboto, narrower) does not load, so a table that fits in it fits in both. Read
# from the font files with fontTools; a character not listed counts as `WIDE`.
_CHARS = "".join(map(chr, range(32, 127))) + "±—–×’"
_REGULAR_EM = (
    "0.318 0.401 0.46 0.838 0.636 0.95 0.78 0.275 0.39 0.39 0.5 0.838 0.318 0.361 0.318 0.337 0.636 0.636 "
    "0.636 0.636 0.636 0.636 0.636 0.636 0.636 0.636 0.337 0.337 0.838 0.838 0.838 0.531 1 0.684 0.686 "
    "0.698 0.77 0.632 0.575 0.775 0.752 0.295 0.295 0.656 0.557 0.863 0.748 0.787 0.603 0.787 0.695 0.635 "
    "0.611 0.732 0.684 0.989 0.685 0.611 0.685 0.39 0.337 0.39 0.838 0.5 0.5 0.613 0.635 0.55 0.635 0.615 "
    "0.352 0.635 0.634 0.278 0.278 0.579 0.278 0.974 0.634 0.612 0.635 0.635 0.411 0.521 0.392 0.634 "
    "0.592 0.818 0.592 0.592 0.525 0.636 0.337 0.636 0.838 0.838 1 0.5 0.838 0.318"
)
REGULAR = dict(zip(_CHARS, map(float, _REGULAR_EM.split()), strict=True))
_BOLD_EM = (
    "0.348 0.456 0.521 0.838 0.696 1.002 0.872 0.306 0.457 0.457 0.523 0.838 0.38 0.415 0.38 0.365 0.696 "
    "0.696 0.696 0.696 0.696 0.696 0.696 0.696 0.696 0.696 0.4 0.4 0.838 0.838 0.838 0.58 1 0.774 0.762 "
    "0.734 0.83 0.683 0.683 0.821 0.837 0.372 0.372 0.775 0.637 0.995 0.837 0.85 0.733 0.85 0.77 0.72 "
    "0.682 0.812 0.774 1.103 0.771 0.724 0.725 0.457 0.365 0.457 0.838 0.5 0.5 0.675 0.716 0.593 0.716 "
    "0.678 0.435 0.716 0.712 0.343 0.343 0.665 0.343 1.042 0.712 0.687 0.716 0.716 0.493 0.595 0.478 "
    "0.712 0.652 0.924 0.645 0.652 0.582 0.712 0.365 0.712 0.838 0.838 1 0.5 0.838 0.38"
)
BOLD = dict(zip(_CHARS, map(float, _BOLD_EM.split()), strict=True))
WIDE = 1.0
CODE_ADVANCE = 0.602  # DejaVu Sans Mono, every character
CODE_SIZE = 0.85  # em of the cell's font: Material's code in text
STYLESHEET = Path(__file__).parents[1] / "stylesheets" / "extra.css"
BREAK_AFTER = re.compile(r"(::|[/._])(?=\w)")  # a browser breaks after `-` by itself


def stylesheet_sizes(css: str) -> tuple[float, float, float]:
    """(font size, a cell's left plus right padding, a header cell's least width), in px, that the stylesheet
    sets for tables."""
    font = re.search(r"table:not\(\[class\]\)\s*\{[^}]*font-size:\s*([\d.]+)rem", css)
    padding = re.search(r"table:not\(\[class\]\) t[hd][^{]*\{[^}]*padding:\s*[\d.]+em\s+([\d.]+)em", css)
    least = re.search(r"table:not\(\[class\]\) th\s*\{[^}]*min-width:\s*([\d.]+)rem", css)
    if font is None or padding is None or least is None:
        raise ValueError(
            f"{STYLESHEET}: no font-size, cell padding or header min-width for "
            "`.md-typeset table:not([class])`"
        )
    size = float(font.group(1)) * ROOT_FONT
    return size, 2 * float(padding.group(1)) * size, float(least.group(1)) * ROOT_FONT


def text_width(text: str, size: float, bold: bool = False) -> float:
    """The width in px of `text` set in DejaVu Sans at `size` px."""
    advance = BOLD if bold else REGULAR
    return sum(advance.get(char, WIDE) for char in text) * size


def cell_min_width(cell: str, size: float, bold: bool = False) -> float:
    """The widest piece of a cell's HTML that cannot wrap: it wraps at spaces, after `-` and at `<wbr>` (not
    after `/`: Chromium keeps `a/b` whole)."""
    widest = 0.0
    for part in re.split(r"(<code>.*?</code>)", cell, flags=re.S):
        code = part.startswith("<code>")
        plain = html.unescape(re.sub(r"<(?!wbr)[^>]*>", "", part))
        pieces = re.split(r"\s+|(?<=-)|<wbr>", plain)
        for piece in pieces:
            width = len(piece) * CODE_ADVANCE * CODE_SIZE * size if code else text_width(piece, size, bold)
            widest = max(widest, width)
    return widest


def table_min_width(table: str, size: float, padding: float, least: float = 0.0) -> float:
    """A table's min-content width in px: per column, its widest cell's `cell_min_width` plus padding, or the
    header's `least` width (padding included) if that is more."""
    columns: dict[int, float] = {}
    for row in re.findall(r"<tr>(.*?)</tr>", table, flags=re.S):
        cells = re.findall(r"<(t[hd])(?:\s[^>]*)?>(.*?)</t[hd]>", row, flags=re.S)
        for index, (tag, cell) in enumerate(cells):
            width = cell_min_width(cell, size, bold=tag == "th")
            columns[index] = max(columns.get(index, 0.0), width)
    return sum(max(width + padding, least) for width in columns.values())


def column_width(hidden: list[str]) -> float:
    """The content column's width at `WINDOW`, with the sidebars a page's `hide:` front matter leaves."""
    sidebars = sum(SIDEBAR for name in ("navigation", "toc") if name not in hidden)
    return WINDOW - sidebars - MARGINS


def too_wide(content: str, hidden: list[str], css: str) -> list[str]:
    """A line for each table of a page's HTML wider than its column: its header and the two widths."""
    size, padding, least = stylesheet_sizes(css)
    available = column_width(hidden)
    found = []
    for table in re.findall(r"<table>.*?</table>", content, flags=re.S):
        width = table_min_width(table, size, padding, least)
        if width > available:
            cells = re.findall(r"<th(?:\s[^>]*)?>(.*?)</th>", table, flags=re.S)
            header = " | ".join(html.unescape(re.sub(r"<[^>]+>", "", cell)) for cell in cells)
            found.append(
                f"a table needs {width:.0f} px where the column is {available:.0f} px at {WINDOW} px wide "
                f"(header: {header[:100]}): fewer or narrower columns"
            )
    return found


def break_code(content: str) -> str:
    """`<wbr>` after each `/`, `.`, `_` and `::` of the code spans inside tables."""

    def in_code(code: re.Match) -> str:
        parts = re.split(r"(<[^>]*>)", code.group(1))  # text between tags only: never an attribute
        return (
            "<code>"
            + "".join(p if p.startswith("<") else BREAK_AFTER.sub(r"\1<wbr>", p) for p in parts)
            + "</code>"
        )

    def in_table(match: re.Match) -> str:
        return re.sub(r"<code>(.*?)</code>", in_code, match.group(), flags=re.S)

    return re.sub(r"<table>.*?</table>", in_table, content, flags=re.S)


def on_page_content(content: str, page, config, files) -> str:
    content = break_code(content)
    for problem in too_wide(content, list(page.meta.get("hide") or []), STYLESHEET.read_text()):
        log.warning(f"{page.file.src_path}: {problem}")
    return content

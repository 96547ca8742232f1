"""The paper's table: one row per evaluation set (and per domain inside a set), its metrics as columns, and
the in-distribution, out-of-distribution and overall averages of each set's headline figure, as the JSON
and Markdown files that `exgrpo validate` and `exgrpo test` write next to a run's logs (`report_files`).

The headline figure of a set is its avg@k: mean correctness over the k samples of each problem, which is
pass@1 for one sample per problem, as the paper reports every benchmark (avg@32 on AIME and AMC).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

# The order columns appear in; a metric not named here follows in name order.
_COLUMN_ORDER = (
    "score",
    "avg@",
    "pass@1",
    "pass@",
    "maj@",
    "greedy_pass@1",
    "mean_length",
    "clipped_ratio",
    "problems",
)


def headline(metrics: Mapping[str, float]) -> float:
    """A set's headline figure: its avg@k."""
    (name,) = [name for name in metrics if name.startswith("avg@")]
    return metrics[name]


def build_table(
    results: Mapping[str, Mapping[str, float]],
    out_of_distribution: Iterable[str] = (),
    by_domain: Iterable[str] = (),
) -> dict:
    """The table of `results` (set or "set/domain" -> metrics), each row led by its headline (`score`), with
    the averages of the sets' headlines.

    The averages are over benchmarks, as the paper's: a set is one benchmark, and its "set/domain" rows are
    shown under it, unless `by_domain` names it: then each of its domains is one (the paper's mixed test
    file), and a set of one domain, which has no "set/domain" rows, is one benchmark still. They are taken
    over the in-distribution benchmarks, the out-of-distribution ones (the sets that `out_of_distribution`
    names) and all.

    Returns:
        `{"rows": {name: {"score": headline, **metrics}}, "averages": {"in-distribution": x,
            "out-of-distribution": y, "all": z}}`, an average left out where it has no set.
    """
    ood, split = set(out_of_distribution), set(by_domain)
    unknown = (ood | split) - set(results)
    if unknown:
        raise ValueError(f"out_of_distribution or by_domain name sets with no results: {sorted(unknown)}")
    # A set averaged by domain that holds one domain has no "set/domain" rows: its own row is that domain's.
    split &= {name.split("/")[0] for name in results if "/" in name}
    benchmarks = {  # name -> (its set, headline)
        name: (name.split("/")[0], headline(metrics))
        for name, metrics in results.items()
        if ("/" in name) == (name.split("/")[0] in split)
    }
    groups = {
        "in-distribution": [v for s, v in benchmarks.values() if s not in ood],
        "out-of-distribution": [v for s, v in benchmarks.values() if s in ood],
        "all": [v for _, v in benchmarks.values()],
    }
    averages = {group: sum(values) / len(values) for group, values in groups.items() if values}
    rows = {name: {"score": headline(metrics), **metrics} for name, metrics in results.items()}
    return {"rows": rows, "averages": averages}


def _columns(rows: Mapping[str, Mapping[str, float]]) -> list[str]:
    names = {metric for metrics in rows.values() for metric in metrics if metric != "samples"}

    def rank(metric: str) -> int:
        return next((i for i, p in enumerate(_COLUMN_ORDER) if metric.startswith(p)), len(_COLUMN_ORDER))

    return sorted(names, key=lambda m: (rank(m), m))


def to_markdown(table: Mapping) -> str:
    """The table as Markdown: rates in percent with one decimal, lengths in tokens."""
    rows, columns = table["rows"], _columns(table["rows"])

    def cell(metric: str, value: float | None) -> str:
        if value is None:
            return ""
        if metric in ("mean_length", "problems"):
            return f"{value:.0f}" if metric == "problems" else f"{value:.1f}"
        return f"{100 * value:.1f}"

    lines = ["| set | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, metrics in rows.items():
        lines.append(f"| {name} | " + " | ".join(cell(m, metrics.get(m)) for m in columns) + " |")
    for group, value in table["averages"].items():
        lines.append(f"| average ({group}) | {100 * value:.1f} |" + " |" * (len(columns) - 1))
    return "\n".join(lines) + "\n"


def report_files(table: Mapping, directory: str | Path, name: str = "evaluation") -> dict[Path, str]:
    """`<name>.json` and `<name>.md` in `directory` -> their text (the table as JSON, and `to_markdown`).

    The JSON also holds `markdown_sha256`, the SHA-256 of the Markdown written with it. Nothing is written
    here: `exgrpo validate` and `exgrpo test` write both files together with
    `exgrpo_pl.checkpoints.atomic_writes.write_files_atomically`, the JSON renamed into place last, so a full
    disk or a kill never leaves a cut file, and a kill between the two renames (the one moment a new
    Markdown can sit beside the previous JSON) leaves a JSON whose digest is not the Markdown's
    (`report_is_whole`).
    """
    directory = Path(directory)
    markdown = to_markdown(table)
    digest = hashlib.sha256(markdown.encode()).hexdigest()
    return {
        directory / f"{name}.json": json.dumps({**table, "markdown_sha256": digest}, indent=1) + "\n",
        directory / f"{name}.md": markdown,
    }


def report_is_whole(json_path: str | Path, markdown_path: str | Path) -> bool:
    """Whether the Markdown table is the one its JSON was written with (the JSON names its SHA-256).

    Args:
        json_path: the report's JSON (`test.json`).
        markdown_path: its Markdown (`test.md`).
    """
    recorded = json.loads(Path(json_path).read_text()).get("markdown_sha256")
    return recorded == hashlib.sha256(Path(markdown_path).read_bytes()).hexdigest()

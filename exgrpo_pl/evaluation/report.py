"""The paper's table: one row per evaluation set (and per domain inside a set), its metrics as columns, and
the in-distribution, out-of-distribution and overall averages of each set's headline figure, written as
JSON and Markdown next to a run's logs.

The headline figure of a set is its avg@k: mean correctness over the k samples of each problem, which is
pass@1 for one sample per problem, as the paper reports every benchmark (avg@32 on AIME and AMC).
"""

from __future__ import annotations

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


def build_table(results: Mapping[str, Mapping[str, float]], out_of_distribution: Iterable[str] = ()) -> dict:
    """The table of `results` (set or "set/domain" -> metrics), each row led by its headline (`score`), with
    the averages of the sets' headlines.

    A "set/domain" row is shown under its set and left out of the averages, which are over whole sets: the
    in-distribution ones, the out-of-distribution ones (`out_of_distribution` names them) and all.

    Returns:
        `{"rows": {name: {"score": headline, **metrics}}, "averages": {"in-distribution": x,
        "out-of-distribution": y, "all": z}}`, an average left out where it has no set.
    """
    ood = set(out_of_distribution)
    unknown = ood - set(results)
    if unknown:
        raise ValueError(f"out_of_distribution names sets with no results: {sorted(unknown)}")
    whole = {name: headline(metrics) for name, metrics in results.items() if "/" not in name}
    groups = {
        "in-distribution": [v for name, v in whole.items() if name not in ood],
        "out-of-distribution": [v for name, v in whole.items() if name in ood],
        "all": list(whole.values()),
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


def write_report(table: Mapping, directory: str | Path, name: str = "evaluation") -> tuple[Path, Path]:
    """Writes `<name>.json` and `<name>.md` into `directory` (made if missing); returns their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = directory / f"{name}.json", directory / f"{name}.md"
    json_path.write_text(json.dumps(table, indent=1) + "\n")
    markdown_path.write_text(to_markdown(table))
    return json_path, markdown_path

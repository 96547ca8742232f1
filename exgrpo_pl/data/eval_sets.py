"""Named evaluation sets: `PromptDataModule(eval_sets={"aime24": EvalSet(path=...), ...})`.

Each set is a file (or saved dataset), a synthetic task, or, given neither, the data module's own validation
rows. A file is read with the data module's column options unless the set gives its own, and its repeated
rows are counted, never dropped: an evaluation file repeats a problem once per sample (the paper's test file
holds each AIME and AMC problem 32 times), so each problem is sampled as often as it appears, or
`num_samples` times when the set says so. The module scores every set on its own and logs
`val/<set>/<metric>` (see `exgrpo_pl.module.evaluation`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from exgrpo_pl.data.loading import load_rows
from exgrpo_pl.data.task import SyntheticTask
from exgrpo_pl.validation import check_number

# The data module's options a set takes over unless it gives its own.
COLUMN_OPTIONS = (
    "prompt_column", "answer_column", "id_column", "domain_column", "answer_from", "drop_system_prompt",
)  # fmt: skip
# Metric names the module logs besides the sets' own: a set may not take them.
RESERVED_NAMES = ("average", "average_id", "average_ood", "pass@1")


@dataclass
class EvalSet:
    """One named evaluation set.

    Args:
        path: a data file or saved-dataset directory (the formats of `load_rows`).
        synthetic: a synthetic task, all of whose rows are evaluated (e.g. a family the policy never trained
            on, for an out-of-distribution set).
        num_samples: completions sampled per problem (the k of avg@k, pass@k, maj@k); None: a file's count
            of each problem's rows, or the module's `val_num_generations` where there is none.
        out_of_distribution: the set counts towards the out-of-distribution average, not the in-distribution
            one.
        average_by_domain: the set holds several benchmarks, one per domain (the paper's in-distribution file
            mixes six): the averages take each domain's score as a benchmark's, not the set's own score,
            which weighs every problem alike.
        prompt_column: as `PromptDataModule`'s; None takes the data module's. So do the next five.
        answer_column: the answer column, a dotted path allowed (`reward_model.ground_truth`).
        id_column: the question id column.
        domain_column: the domain column (verl's `data_source`): a set that mixes domains is also reported
            per domain.
        answer_from: "column" or "boxed".
        drop_system_prompt: drop the leading system messages of a message-list prompt.
    """

    path: str | None = None
    synthetic: SyntheticTask | None = None
    num_samples: int | None = None
    out_of_distribution: bool = False
    average_by_domain: bool = False
    prompt_column: str | None = None
    answer_column: str | None = None
    id_column: str | None = None
    domain_column: str | None = None
    answer_from: str | None = None
    drop_system_prompt: bool | None = None

    def __post_init__(self) -> None:
        if self.path is not None and self.synthetic is not None:
            raise ValueError(f"EvalSet: give a path or a synthetic task, not both (path={self.path!r})")
        check_number("EvalSet", "num_samples", self.num_samples, 1, integer=True, optional=True)


def check_names(eval_sets: Mapping[str, Any]) -> None:
    """Raises ValueError for a set name that cannot be a metric's path segment or is one the module logs."""
    for name in eval_sets:
        if not name or "/" in name or name in RESERVED_NAMES:
            raise ValueError(
                f"eval_sets: {name!r} cannot name a set (it becomes val/<set>/<metric>: no '/', not empty,"
                f" none of {list(RESERVED_NAMES)})"
            )


def eval_rows(
    name: str, spec: EvalSet, defaults: Mapping[str, Any], held_out: Callable[[], list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The rows of set `name`, each with `num_samples` (an int, or None for the module's default).

    Args:
        name: the set's name, for the messages.
        spec: the set.
        defaults: the data module's column options (`prompt_column`, ..., `drop_system_prompt`).
        held_out: the data module's validation rows, for a set with neither a path nor a task.
    """
    if spec.path is not None:
        options = {
            key: getattr(spec, key) if getattr(spec, key) is not None else defaults[key] for key in defaults
        }
        rows = load_rows(spec.path, **options, count_repeats=True)
    else:
        rows = [dict(row) for row in (spec.synthetic.rows() if spec.synthetic is not None else held_out())]
        for row in rows:
            row["num_samples"] = None
    if not rows:
        raise ValueError(f"eval_sets[{name!r}]: no rows (the data module's validation split is empty)")
    if spec.num_samples is not None:
        for row in rows:
            row["num_samples"] = spec.num_samples
    return rows

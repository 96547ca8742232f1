"""A reward function that scores each row with the reward function of its source, as verl's
`default_compute_score(data_source, ...)` does: the paper's evaluation files mix benchmarks (math, and
multiple-choice science) in one file, told apart by their `data_source` column.

`PromptDataModule(domain_column="data_source")` puts that column in each row as `domain`, which is what
`RewardBySource` routes by unless told another column.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from exgrpo_pl.rewards.base import Completion, Prompt, reward_name


def _per_row(value: Any, n: int) -> bool:
    """Whether a keyword argument is a column (one value per row) rather than one object for the whole
    batch, like TRL's `trainer_state` and `log_metric`."""
    return (
        hasattr(value, "__len__")
        and hasattr(value, "__getitem__")
        and not isinstance(value, (str, bytes, Mapping))
        and len(value) == n
    )


class RewardBySource:
    """Scores each row with the reward function its `column` names, e.g. `{"gpqa": MultipleChoiceReward(),
    "math": MathVerifyReward()}`.

    Each function is called once per batch, with its own rows only: the prompts, completions and every
    column cut down to them (keyword arguments that are not one value per row, like TRL's `trainer_state`,
    pass unchanged). A function routed from several sources gets all their rows in one call. Its scores go
    back to their rows; a `None` stays `None` (the function does not apply to that row, as in TRL), and a
    source mapped to `None` gets `None` for all its rows.

    Time limit: it is `in_process` (see `RewardFunction`) when every function it routes to is, so those
    bound themselves here (a `MathVerifyReward` keeps its worker process across batches); otherwise the
    whole call runs in `compute_rewards`' worker process under its limit, the functions with it (a
    `MathVerifyReward` among them then starts a worker of its own there at every call, a second or so).

    Args:
        rewards: source -> the reward function scoring that source's rows, or None for no score.
        default: the reward function of the rows whose source `rewards` does not name; None: such a row is
            an error.
        column: the column holding each row's source.
        name: the name its scores are logged under.

    Raises:
        TypeError: on a reward function that is not callable.
        ValueError: on no reward functions at all.
    """

    def __init__(
        self,
        rewards: dict[str, Callable[..., Any] | None],
        default: Callable[..., Any] | None = None,
        column: str = "domain",
        name: str = "by_source",
    ) -> None:
        for source, fn in rewards.items():
            if fn is not None and not callable(fn):
                raise TypeError(f"RewardBySource: the reward function of {source!r} is not callable: {fn!r}")
        if default is not None and not callable(default):
            raise TypeError(f"RewardBySource: default is not callable: {default!r}")
        if default is None and not any(fn is not None for fn in rewards.values()):
            raise ValueError("RewardBySource needs at least one reward function (in `rewards` or `default`)")
        self.rewards = dict(rewards)
        self.default = default
        self.column = column
        self.name = name

    @property
    def in_process(self) -> bool:
        """True when every function it routes to is `in_process` (see the class docstring)."""
        functions = [*self.rewards.values(), self.default]
        return all(getattr(fn, "in_process", False) for fn in functions if fn is not None)

    def __call__(
        self, prompts: list[Prompt], completions: list[Completion], **columns: Any
    ) -> list[float | None]:
        """Scores each row with its source's reward function.

        Args:
            prompts: the prompts.
            completions: the model's completions.
            **columns: the dataset columns, `column` among them, and any other keyword arguments.

        Raises:
            ValueError: when `column` is missing or not one value per row, a row's source has no reward
                function and there is no default (naming the sources), or a function returns the wrong number
                of scores.
            TypeError: when a function returns something that is not a sequence of scores.
        """
        if self.column not in columns:
            raise ValueError(
                f"reward function {self.name!r} routes rows by the {self.column!r} column, which the batch"
                f" lacks; columns present: {sorted(columns)}"
            )
        sources = columns[self.column]
        n = len(completions)
        if not _per_row(sources, n):
            raise ValueError(
                f"reward function {self.name!r} routes rows by the {self.column!r} column, which does not"
                " hold one value per row"
            )
        # Rows grouped by the function that scores them, keyed by identity: one call per function.
        routes: dict[int, tuple[Callable[..., Any], list[int], list[Any]]] = {}
        unknown: dict[Any, list[int]] = {}
        scores: list[float | None] = [None] * n
        for row, source in enumerate(sources):
            if source in self.rewards:
                fn = self.rewards[source]
                if fn is None:
                    continue  # not scored: its row keeps None
            elif self.default is not None:
                fn = self.default
            else:
                unknown.setdefault(source, []).append(row)
                continue
            _, rows, routed = routes.setdefault(id(fn), (fn, [], []))
            rows.append(row)
            if source not in routed:
                routed.append(source)
        if unknown:
            found = ", ".join(f"{source!r} (rows {rows[:5]})" for source, rows in unknown.items())
            raise ValueError(
                f"reward function {self.name!r} has no reward function for source {found}, and no default;"
                f" its sources: {sorted(map(str, self.rewards))}"
            )
        batch = {"prompts": prompts, "completions": completions, **columns}
        for fn, rows, routed in routes.values():
            result = fn(**{key: [v[i] for i in rows] if _per_row(v, n) else v for key, v in batch.items()})
            where = f"reward function {reward_name(fn)!r} (of {self.name!r}, sources {routed})"
            if isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
                raise TypeError(f"{where} returned {type(result).__name__}, not one score per completion")
            if len(result) != len(rows):
                raise ValueError(f"{where} returned {len(result)} scores for {len(rows)} completions")
            for row, value in zip(rows, result):
                scores[row] = value
        return scores

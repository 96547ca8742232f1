"""A reward function that scores each row with the reward function of its source, as verl's
`default_compute_score(data_source, ...)` does: the paper's evaluation files mix benchmarks (math, and
multiple-choice science) in one file, told apart by their `data_source` column.

`PromptDataModule(domain_column="data_source")` puts that column in each row as `domain`, which is what
`RewardBySource` routes by unless told another column.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from exgrpo_pl.rewards.base import Completion, Prompt, reward_name
from exgrpo_pl.rewards.protocol import is_async

_UNKNOWN = object()  # `_function_of`: the source has no function and there is no default


def _per_row(value: Any, n: int) -> bool:
    """Whether a keyword argument is a column (one value per row) rather than one object for the whole
    batch, like TRL's `trainer_state` and `log_metric`."""
    return (
        hasattr(value, "__len__")
        and hasattr(value, "__getitem__")
        and not isinstance(value, (str, bytes, Mapping))
        and len(value) == n
    )


def source_key(source: Any) -> Any:
    """A source as routing compares it: an integer as its text (a YAML key `7:` and a `data_source` of 7 read
    from a file, which the data module turns into "7", are the same source), anything else as it is."""
    return str(source) if isinstance(source, int) and not isinstance(source, bool) else source


def _takes_columns(method: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def extract_answer(fn: Callable[..., Any], completion: Completion, columns: Mapping[str, Any]) -> str | None:
    """The answer reward function `fn` reads in a completion, for majority voting (maj@k): its
    `extract_answer(completion)`, which also gets the row's dataset columns (one value each) when it takes
    keyword arguments (`**columns`, as `RewardBySource`'s does: it asks the function of the row's source).
    None when `fn` has no `extract_answer` or reads no answer.

    Args:
        fn: a reward function.
        completion: the model's completion: text, or conversational.
        columns: the row's dataset columns, column -> value.
    """
    method = getattr(fn, "extract_answer", None)
    if method is None:
        return None
    return method(completion, **columns) if _takes_columns(method) else method(completion)


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

    Majority voting (maj@k) reads each row's answer with its source's function (`extract_answer`).

    With an `async def` function among them, the instance is an `AsyncRewardBySource`, itself awaited by
    `compute_rewards` with the step's other async functions: it awaits its async functions concurrently.

    Args:
        rewards: source -> the reward function scoring that source's rows, or None for no score. An integer
            source is its text (`source_key`): the key `7` routes the rows whose source is 7 or "7".
        default: the reward function of the rows whose source `rewards` does not name; None: such a row is
            an error.
        column: the column holding each row's source.
        name: the name its scores are logged under.

    Raises:
        TypeError: on a reward function that is not callable.
        ValueError: on no reward functions at all, or two sources that are the same as text (`7` and "7").
    """

    def __new__(
        cls,
        rewards: dict[str, Callable[..., Any] | None],
        default: Callable[..., Any] | None = None,
        column: str = "domain",
        name: str = "by_source",
    ) -> RewardBySource:
        # Whether a call must be awaited is a property of the class (TRL's `is_async_callable` reads
        # `type(fn).__call__`), so routing to an async function makes the instance the async class. The
        # signature is `__init__`'s: jsonargparse reads a class's options from it.
        functions = [fn for fn in [*getattr(rewards, "values", list)(), default] if callable(fn)]
        if cls is RewardBySource and any(is_async(fn) for fn in functions):
            cls = AsyncRewardBySource
        return super().__new__(cls)

    def __getnewargs__(self) -> tuple:
        """What `__new__` gets back when the instance is unpickled or copied."""
        return (self.rewards, self.default)

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
        self.rewards: dict[Any, Callable[..., Any] | None] = {}
        for source, fn in rewards.items():
            key = source_key(source)
            if key in self.rewards:
                raise ValueError(
                    f"RewardBySource: sources {source!r} and {key!r} are the same source; keep one"
                )
            self.rewards[key] = fn
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
        calls = self._calls(prompts, completions, columns)
        return self._scores(len(completions), calls, [fn(**kwargs) for fn, _, _, kwargs in calls])

    def _calls(self, prompts: list[Prompt], completions: list[Completion], columns: dict[str, Any]) -> list:
        """One call per function: `(function, its rows, their sources, its keyword arguments)`."""
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
        for row, source in enumerate(sources):
            fn = self._function_of(source)
            if fn is _UNKNOWN:
                unknown.setdefault(source, []).append(row)
                continue
            if fn is None:
                continue  # not scored: its row keeps None
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
        return [
            (
                fn,
                rows,
                routed,
                {key: [v[i] for i in rows] if _per_row(v, n) else v for key, v in batch.items()},
            )
            for fn, rows, routed in routes.values()
        ]

    def _scores(self, n: int, calls: list[tuple], results: list[Any]) -> list[float | None]:
        """Each call's scores put back in their rows, checked."""
        scores: list[float | None] = [None] * n
        for (fn, rows, routed, _), result in zip(calls, results):
            where = f"reward function {reward_name(fn)!r} (of {self.name!r}, sources {routed})"
            if isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
                raise TypeError(f"{where} returned {type(result).__name__}, not one score per completion")
            if len(result) != len(rows):
                raise ValueError(f"{where} returned {len(result)} scores for {len(rows)} completions")
            for row, value in zip(rows, result):
                scores[row] = value
        return scores

    def _function_of(self, source: Any) -> Any:
        """The function of rows from `source`: its own, None (not scored), the default, or `_UNKNOWN`."""
        key = source_key(source)
        if key in self.rewards:
            return self.rewards[key]
        return self.default if self.default is not None else _UNKNOWN

    def extract_answer(self, completion: Completion, **columns: Any) -> str | None:
        """The answer the function of the row's source reads in a completion (see `extract_answer`), for
        majority voting; None where that function reads none, or the source is not scored.

        Args:
            completion: the model's completion.
            **columns: the row's dataset columns, one value each, `column` among them.

        Raises:
            ValueError: when `column` is missing, or the row's source has no function and there is no default.
        """
        if self.column not in columns:
            raise ValueError(
                f"reward function {self.name!r} reads answers by the {self.column!r} column, which the row"
                f" lacks; columns present: {sorted(columns)}"
            )
        source = columns[self.column]
        fn = self._function_of(source)
        if fn is _UNKNOWN:
            raise ValueError(
                f"reward function {self.name!r} has no reward function for source {source!r}, and no default;"
                f" its sources: {sorted(map(str, self.rewards))}"
            )
        return None if fn is None else extract_answer(fn, completion, columns)


class AsyncRewardBySource(RewardBySource):
    """`RewardBySource` routing to at least one `async def` function (`RewardBySource(...)` returns one): its
    call is awaited, and awaits its async functions concurrently; the others are called directly."""

    async def __call__(
        self, prompts: list[Prompt], completions: list[Completion], **columns: Any
    ) -> list[float | None]:
        """Scores each row with its source's reward function (see `RewardBySource.__call__`)."""
        calls = self._calls(prompts, completions, columns)

        async def score(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
            result = fn(**kwargs)
            return await result if inspect.isawaitable(result) else result

        results = await asyncio.gather(*(score(fn, kwargs) for fn, _, _, kwargs in calls))
        return self._scores(len(completions), calls, list(results))

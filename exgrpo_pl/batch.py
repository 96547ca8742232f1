"""RolloutBatch: the trajectories a training step trained on, as the module hands them to the callbacks.

This is the unit of exchange between a GRPO module and the replay callbacks (`exgrpo_pl.contract`,
docs/replay_contract.md): `training_step` returns one, the replay callback feeds it to the buffer, and the
buffer hands sampled experience back as one. Plain PyTorch, no Lightning, so a hand-written loop can use it
too.

Layout: rows are trajectories. Prompts are left-padded (generation appends on the right), completions are
right-padded. Rows that share a question sit next to each other in groups of `group_size`.

`stored_column_value` says what a dataset column's value may be for the buffer to keep it (what a checkpoint
loaded with `torch.load(weights_only=True)` reads back) and copies it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

_TENSOR_FIELDS = (
    "question_ids",
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "behaviour_logps",
    "rewards",
    "correct",
    "entropy",
    "advantages",
    "policy_version",
    "replayed",
)
_LIST_FIELDS = ("prompts", "completions", "answers", "domains")
# Fields of named per-row lists (name -> `N` values), or None.
_DICT_FIELDS = ("columns", "extra")
# Fields whose dtype must be bool: `~mask` on an integer tensor is a bitwise not (-1, -2), not a negation, and
# indexing with an integer "mask" gathers rows instead of selecting them.
_BOOL_FIELDS = {
    "prompt_mask": "a tokenizer's attention_mask.bool()",
    "completion_mask": "completion_mask.bool()",
    "correct": "rewards > 0.5",
    "replayed": "torch.zeros(n, dtype=torch.bool) for fresh rows",
}


@dataclass
class RolloutBatch:
    """Trajectories with everything replay needs to re-use them later.

    Args:
        question_ids: `[N]` long. Stable id of each row's question (the buffer keys on it).
        prompt_ids: `[N, P]` long, left-padded prompt tokens.
        prompt_mask: `[N, P]` bool, True on real prompt tokens.
        completion_ids: `[N, C]` long, right-padded completion tokens.
        completion_mask: `[N, C]` bool, True on real completion tokens.
        behaviour_logps: `[N, C]` float32. Log-probability of each completion token under the policy that
            produced it (the behaviour policy); 0 on padding. Importance weights need only this.
        rewards: `[N]` float. Total (weighted) reward.
        correct: `[N]` bool. `reward > correct_threshold` as judged when the row was scored.
        entropy: `[N]` float. Mean token entropy over the completion tokens (padding excluded).
        advantages: `[N]` float. Advantage the row was trained with.
        policy_version: `[N]` long. Global step of the policy that generated the row.
        replayed: `[N]` bool. True for rows that came out of the buffer rather than fresh generation.
        group_size: rows `[g*group_size, (g+1)*group_size)` share one question. 1 for a batch of
            independent trajectories (a swap-mode replay batch).
        prompts: `N` prompt strings.
        completions: `N` decoded completion strings.
        answers: `N` reference answers (the dataset's answer column).
        domains: optional `N` task/domain names, for per-domain difficulty statistics.
        columns: optional dataset columns of each row's question, column name -> `N` values, as the reward
            functions received them (TRL's keyword arguments: `answer`, `solution`, verl's `extra_info`, ...,
            `domain` included). The buffer keeps them once per question, and a replayed question's fresh
            rollouts are scored with them. None: the batch carries none (only `answers` and `domains`).
        extra: optional values the reward functions logged for each row with `log_extra` (TRL's extra
            columns of its completions table), column name -> `N` values; None where a row has none (a
            stored row: the buffer does not keep them). None: the batch carries none.
    """

    question_ids: Tensor
    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    behaviour_logps: Tensor
    rewards: Tensor
    correct: Tensor
    entropy: Tensor
    advantages: Tensor
    policy_version: Tensor
    replayed: Tensor
    group_size: int = 1
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    domains: list[str] | None = None
    columns: dict[str, list[Any]] | None = None
    extra: dict[str, list[Any]] | None = None

    def __post_init__(self) -> None:
        for name, example in _BOOL_FIELDS.items():
            dtype = getattr(self, name).dtype
            if dtype != torch.bool:
                raise TypeError(f"RolloutBatch.{name} is {dtype}; {name} must be bool (e.g. {example})")
        n = self.question_ids.shape[0]
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if value.shape[0] != n:
                raise ValueError(f"RolloutBatch.{name} has {value.shape[0]} rows, question_ids has {n}")
        for name in _LIST_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) not in (0, n):
                raise ValueError(f"RolloutBatch.{name} has {len(value)} entries, question_ids has {n}")
        for name in _DICT_FIELDS:
            for key, values in (getattr(self, name) or {}).items():
                if len(values) != n:
                    raise ValueError(f"RolloutBatch.{name}[{key!r}] has {len(values)} values for {n} rows")
        if self.group_size < 1 or n % self.group_size:
            raise ValueError(f"RolloutBatch of {n} rows cannot be split into groups of {self.group_size}")

    def __len__(self) -> int:
        return self.question_ids.shape[0]

    # The reference description's hand-written loop reads a replay batch as a dict with these keys.
    _SEED_KEYS = {"prompts": "prompts", "rollouts": "completions", "rewards": "rewards"}

    def __getitem__(self, key: str):
        """`batch["prompts"]`, `batch["rollouts"]`, `batch["rewards"]`: the reference description's names for
        the columns."""
        if key not in self._SEED_KEYS:
            keys = sorted(self._SEED_KEYS)
            raise KeyError(f"RolloutBatch has no key {key!r}; the reference description's keys are {keys}")
        return getattr(self, self._SEED_KEYS[key])

    def select(self, index: Tensor | Sequence[int], group_size: int = 1) -> RolloutBatch:
        """The rows at `index` (a bool mask or integer indices), grouped by `group_size`."""
        index = torch.as_tensor(index, device=self.question_ids.device)
        if index.dtype == torch.bool:
            index = index.nonzero().flatten()
        rows = index.tolist()
        values = {name: getattr(self, name)[index] for name in _TENSOR_FIELDS}
        for name in _LIST_FIELDS:
            value = getattr(self, name)
            values[name] = None if value is None else ([value[i] for i in rows] if value else [])
        for name in _DICT_FIELDS:
            if getattr(self, name) is not None:
                values[name] = {key: [column[i] for i in rows] for key, column in getattr(self, name).items()}
        return replace(self, group_size=group_size, **values)

    def question_columns(self, rows: Iterable[int]) -> dict[int, dict[str, Any]]:
        """Each question's dataset columns among `rows`, as copies the buffer can keep: question id ->
        {column: `stored_column_value`}, from the question's last row in `rows` (its rows hold the same
        values). Empty when the batch carries no columns.

        Raises:
            TypeError: a value holds something a checkpoint cannot (see `stored_column_value`).
        """
        if self.columns is None:
            return {}
        question_ids = self.question_ids.tolist()
        last_row = {question_ids[r]: r for r in rows}
        return {
            question: {
                key: stored_column_value(values[r], f"column {key!r} of question_id={question}")
                for key, values in self.columns.items()
            }
            for question, r in last_row.items()
        }

    def to(self, device: torch.device | str) -> RolloutBatch:
        return replace(self, **{name: getattr(self, name).to(device) for name in _TENSOR_FIELDS})

    @property
    def sequences(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`(prompt_ids, prompt_mask, completion_ids, completion_mask)`: what a policy forward reads."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask

    @property
    def completion_lengths(self) -> Tensor:
        """`[N]` number of real completion tokens per row."""
        return self.completion_mask.sum(-1)

    @staticmethod
    def cat(batches: Sequence[RolloutBatch], group_size: int | None = None) -> RolloutBatch:
        """Concatenate rows, re-padding prompts (left) and completions (right) to a common width."""
        if not batches:
            raise ValueError("RolloutBatch.cat needs at least one batch")
        if group_size is None:
            sizes = {b.group_size for b in batches}
            if len(sizes) != 1:
                raise ValueError(f"RolloutBatch.cat of mixed group sizes {sorted(sizes)}: pass group_size")
            group_size = sizes.pop()
        p = max(b.prompt_ids.shape[1] for b in batches)
        c = max(b.completion_ids.shape[1] for b in batches)
        values: dict[str, object] = {}
        for name in _TENSOR_FIELDS:
            parts = [getattr(b, name) for b in batches]
            if name in ("prompt_ids", "prompt_mask"):
                parts = [_pad_to(t, p, left=True) for t in parts]
            elif name in ("completion_ids", "completion_mask", "behaviour_logps"):
                parts = [_pad_to(t, c, left=False) for t in parts]
            values[name] = torch.cat(parts)
        for name in _LIST_FIELDS:
            parts = [getattr(b, name) for b in batches]
            if name == "domains" and any(x is None for x in parts):
                values[name] = None
            elif all(parts) or not any(parts):
                values[name] = [item for part in parts for item in part]
            else:  # a batch without texts next to one with them: "" per row keeps one entry per row
                values[name] = [item for b, part in zip(batches, parts) for item in (part or [""] * len(b))]
        for name in _DICT_FIELDS:
            values[name] = _cat_columns(batches, name)
        return RolloutBatch(group_size=group_size, **values)


def _cat_columns(batches: Sequence[RolloutBatch], name: str = "columns") -> dict[str, list[Any]] | None:
    """The batches' columns (or another of `_DICT_FIELDS`) concatenated: the union of their keys, None where
    a batch lacks a key (as a dataset holds None where a row lacks a column); None when no batch has any."""
    dicts = [getattr(b, name) for b in batches]
    if all(d is None for d in dicts):
        return None
    keys = dict.fromkeys(key for d in dicts for key in (d or {}))
    return {
        key: [value for b, d in zip(batches, dicts) for value in (d or {}).get(key, [None] * len(b))]
        for key in keys
    }


# A stored column value is built of these exact types (a subclass, e.g. NumPy's float64, pickles as itself,
# which `torch.load(weights_only=True)` refuses), tensors, and lists, tuples and dicts of them.
_PRIMITIVES = (type(None), bool, int, float, str)


def stored_column_value(value: Any, where: str, path: str = "value") -> Any:
    """A copy of a dataset column's value that a checkpoint holds and `torch.load(weights_only=True)` reads
    back equal: None, bool, int, float, str, a tensor (copied to the CPU, detached), and lists, tuples and
    dicts (keys None, bool, int, float or str) of these, copied all the way down, so that what the buffer
    keeps does not change when the batch's objects do.

    Args:
        value: the column's value for one question.
        where: what the value is, for the message (e.g. "column 'extra_info' of question_id=7").
        path: where inside the value this part is, for the message.

    Raises:
        TypeError: naming `where`, the part and its type, on anything else (a NumPy scalar or array, a
            date, bytes, a set, an object).
    """
    kind = type(value)
    if kind in _PRIMITIVES:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True).as_subclass(torch.Tensor)
    if kind is list or kind is tuple:
        return kind(stored_column_value(item, where, f"{path}[{i}]") for i, item in enumerate(value))
    if kind is dict:
        copy = {}
        for key, item in value.items():
            if type(key) not in _PRIMITIVES:
                raise TypeError(_not_storable(where, f"a key of {path}", key))
            copy[key] = stored_column_value(item, where, f"{path}[{key!r}]")
        return copy
    raise TypeError(_not_storable(where, path, value))


def _not_storable(where: str, part: str, value: Any) -> str:
    kind = type(value)
    return (
        f"{where}: {part} is a {kind.__module__}.{kind.__qualname__} ({value!r:.60}); the replay buffer "
        "keeps each question's dataset columns in its checkpoint, which holds None, bool, int, float, str, "
        "torch.Tensor and lists, tuples and dicts of them (what torch.load(weights_only=True) reads back). "
        "Convert it in the dataset: .item() for a NumPy scalar, .tolist() for an array, str() for a date"
    )


def _pad_to(t: Tensor, width: int, left: bool) -> Tensor:
    missing = width - t.shape[1]
    if missing == 0:
        return t
    pad = t.new_zeros(t.shape[0], missing)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def pad_sequences(rows: Sequence[Tensor], left: bool, pad_value: int | float = 0) -> tuple[Tensor, Tensor]:
    """Stack 1-D tensors of different lengths into `[N, max_len]` plus a bool mask of the real entries."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if len(rows) else 0
    positions = torch.arange(width)
    mask = positions >= width - lengths.unsqueeze(1) if left else positions < lengths.unsqueeze(1)  # [N, W]
    out = torch.full(mask.shape, pad_value, dtype=rows[0].dtype if len(rows) else torch.long)
    if len(rows):
        # A boolean-mask write fills row by row, left to right: one concatenation and one write, instead of
        # two tensor writes per row.
        out[mask] = torch.cat(list(rows))
    return out, mask


def text_id(text: str) -> int:
    """A stable 63-bit question id for a text (a prompt, or a string id): BLAKE2b of its UTF-8 bytes.

    Two different texts get the same id with probability about n^2 / 2^64 over n texts (5e-10 for 100K
    questions); a 32-bit hash such as CRC-32 collides with even odds at about 77K.
    """
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF

"""How rows become training and validation batches: rows as a dataset (`RowDataset`), a batch of rows
(`collate_rows`), the training sampler that leaves retired questions out of each pass and shards it across
ranks (`ExcludingRandomSampler`), and the training loader that saves and restores its pass and position
(`ResumableLoader`). Used by `PromptDataModule` (`exgrpo_pl.data.datamodule`, which explains the passes).
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any

import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from exgrpo_pl.seeding import split_seed

_FIXED_KEYS = ("id", "prompt", "answer", "domain")

# torchdata 0.11 calls torch.set_vital on every loader it builds and torch warns that the call is deprecated:
# a warning about torchdata's internals that a user can do nothing about, printed by every run.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class RowDataset(Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.rows[index]


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Turns rows into a batch: `prompt`, `answer`, `question_id` (`[B]` long), `domain` and other columns.

    `domain` is present when any row has one; every other column is a list with None where a row lacks it.

    Args:
        rows: rows as `load_rows` or `ArithmeticTask` make them.
    """
    batch: dict[str, Any] = {
        "prompt": [row["prompt"] for row in rows],
        "answer": [row["answer"] for row in rows],
        "question_id": torch.tensor([row["id"] for row in rows], dtype=torch.long),
    }
    if any("domain" in row for row in rows):
        batch["domain"] = [row.get("domain") for row in rows]
    extra = dict.fromkeys(key for row in rows for key in row if key not in _FIXED_KEYS)
    for key in extra:
        batch[key] = [row.get(key) for row in rows]
    return batch


def check_enough_left(sampler: ExcludingRandomSampler, batch_size: int) -> None:
    """Raises RuntimeError when the pass just drawn holds fewer questions than a batch (a batch would hold
    a question twice), unless the run started with fewer."""
    left = len(sampler.order)
    if left < min(batch_size, sampler.start_rows):
        raise RuntimeError(
            f"only {left} of {len(sampler.question_ids)} training questions are left (the others are"
            f" retired), fewer than one batch of {batch_size}; nothing is left to train on"
        )


def question_fingerprint(question_ids: Sequence[int]) -> dict[str, int]:
    """Which training questions there are, in order: `{"rows": count, "crc32": of their ids}`."""
    return {"rows": len(question_ids), "crc32": zlib.crc32(",".join(map(str, question_ids)).encode())}


def check_same_questions(saved: dict[str, int] | None, now: dict[str, int], source: str) -> None:
    """Raises ValueError when a restored state was saved with other training questions (`saved`; None:
    unknown) than the run's (`now`, from `source`): its pass, epoch length and retired ids are of others."""
    if saved is None or saved == now:
        return
    count = f"{saved['rows']} then, {now['rows']} now"
    if saved["rows"] == now["rows"]:
        count = f"{now['rows']} both times, but other questions or another order"
    raise ValueError(
        f"Resuming: the training questions of {source} are not those the checkpoint was trained on ({count}),"
        " so its data order, epoch length and retired questions do not apply to them. Resume with the"
        " checkpoint's training data (the same train_path, val_path, val_fraction, seed and column options),"
        " or start a new run for the new data"
    )


class ExcludingRandomSampler(DistributedSampler):
    """Shuffles the dataset indices of one pass (epoch), skipping the rows whose question id is excluded, and
    shards the pass across ranks itself.

    `begin_pass()` draws the order of pass `epoch` from a generator seeded by `split_seed(seed, epoch)`, with
    the excluded set as it is then, and moves `epoch` on by one; iterating yields this rank's share of the
    current pass, the same each time, so a resumed pass is the pass that was saved (`pass_state` /
    `restore_pass`). Iterating before any pass begins one.

    Every pass has the same length on every rank, `ceil(start_rows / num_replicas)`: the order is cut or
    padded to `num_replicas` times that (once questions are retired, the freed slots repeat the first
    remaining ones of the order), and rank r takes every `num_replicas`-th entry from r on.

    It subclasses `DistributedSampler` only so that Lightning does not wrap it in a
    `DistributedSamplerWrapper`, whose own shuffle and eager listing a resumed run could not restore.
    `exgrpo_pl.data.stream.PassStream` hands the same passes out as one stream (`is_stream`).

    Args:
        question_ids: the question id of each dataset index.
        excluded: the excluded question ids; kept by reference, so later additions are seen.
        seed: seed of the shuffle.
        num_replicas: ranks that share the data.
        rank: this rank.
        start_rows: active rows when the run started, which sets the length of every pass; None: the active
            rows now.
    """

    is_stream = False  # PassStream: iterating goes on from its own position, across epochs

    def __init__(
        self,
        question_ids: Sequence[int],
        excluded: Set[int],
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        start_rows: int | None = None,
    ) -> None:
        # DistributedSampler.__init__ is not called: it wants a dataset and a process group. The attributes
        # that others read from a DistributedSampler are set here.
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.question_ids = list(question_ids)
        self.excluded = excluded
        self.seed = seed
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.drop_last = True, False
        self.epoch = 0
        self.start_rows = len(self._active()) if start_rows is None else start_rows
        self.num_samples = math.ceil(self.start_rows / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.order: list[int] | None = None  # the current pass, before sharding
        self.order_epoch = -1

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the sampler counts its own passes. Lightning calls this before each epoch, but its count
        runs one ahead after resuming from a checkpoint saved when `max_steps` stopped a run mid-epoch."""

    def _active(self) -> list[int]:
        return [index for index, qid in enumerate(self.question_ids) if qid not in self.excluded]

    def begin_pass(self) -> None:
        """Draws the order of pass `epoch` over the questions not excluded now."""
        active = self._active()
        if not active:
            raise RuntimeError(
                f"all {len(self.question_ids)} training questions are retired; nothing is left to train on"
            )
        generator = torch.Generator().manual_seed(split_seed(self.seed, self.epoch))
        self.order = [active[i] for i in torch.randperm(len(active), generator=generator).tolist()]
        self.order_epoch = self.epoch
        self.epoch += 1

    def _shard(self) -> list[int]:
        repeats = math.ceil(self.total_size / len(self.order))
        return (self.order * repeats)[: self.total_size][self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if self.order is None:
            self.begin_pass()
        return iter(self._shard())

    def pass_state(self, finished: bool) -> dict[str, Any]:
        """The current pass: its seed and epoch, and unless `finished` its order (`[n]` long tensor)."""
        order = None if finished or self.order is None else torch.tensor(self.order, dtype=torch.long)
        return {"seed": self.seed, "epoch": self.order_epoch, "order": order}

    def restore_pass(self, state: dict[str, Any]) -> None:
        """Makes the saved pass current (or, when it has no order, the next `begin_pass` draw the epoch after
        it); the seed is the saved one, so the resumed run goes on with the same data order."""
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"]) + 1
        self.order = None if state["order"] is None else state["order"].tolist()
        self.order_epoch = int(state["epoch"])


class ResumableLoader(StatefulDataLoader):
    """A torchdata `StatefulDataLoader` over an `ExcludingRandomSampler` that begins a new pass of it when an
    epoch's iteration starts, and saves the pass's order with the position in it.

    Lightning saves the `state_dict` of a training loader that has one, with the loops, and loads it into
    the new run's loader before iterating it. A pass whose epoch is over (every batch taken, or as many as
    `epoch_batches()` says an epoch has: Lightning's `limit_train_batches`) is saved without position, so a
    run resumed from its end begins the next pass, as the uninterrupted run does. An iteration started again
    before it took a batch (Lightning does so on some resumes) goes over the same pass from the same place
    instead of beginning another.

    Over a `PassStream` (`exgrpo_pl.data.stream`) it begins no pass: each iteration goes on from the
    stream's position, which draws passes itself, and the state saved is the stream's.

    Its state also records which training questions the sampler draws from (`question_fingerprint`): a state
    saved over other questions (another file, split or ids) is refused (`check_same_questions`), since its
    pass, position and epoch length are of other data.

    Args:
        args: `StatefulDataLoader`'s.
        epoch_batches: the most batches an epoch takes; None: no limit.
        before_pass: called right before each new pass is drawn.
        source: where the training questions come from, for the messages.
        kwargs: `StatefulDataLoader`'s.
    """

    def __init__(
        self,
        *args: Any,
        epoch_batches: Callable[[], float] | None = None,
        before_pass: Callable[[], None] | None = None,
        source: str = "the training data",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_batches = epoch_batches
        self.before_pass = before_pass
        self.source = source
        self._restored: dict[str, Any] | None = None  # the position loaded, until a batch is taken after it
        self._taken_at_start = 0

    def __iter__(self):
        if self.sampler.is_stream:  # every iterator goes on from the stream's own position
            return super().__iter__()
        iterator = self._iterator
        # `_num_yielded` counts the batches an iterator handed out (torch's DataLoader iterator).
        untouched = iterator is not None and iterator._num_yielded == self._taken_at_start
        if untouched and self._restored is not None:
            super().load_state_dict(self._restored)
        elif (iterator is not None and not untouched) or (iterator is None and self._restored is None):
            self._restored = None
            if self.before_pass is not None:
                self.before_pass()
            self.sampler.begin_pass()
            check_enough_left(self.sampler, self.batch_size)
        iterator = super().__iter__()
        self._taken_at_start = iterator._num_yielded
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """`{"pass": the sampler's pass, "loader": torchdata's state, None at the end of the pass}`; over a
        `PassStream`, `{"pass": the stream's state, "loader": None}` (the stream holds its position)."""
        questions = question_fingerprint(self.sampler.question_ids)
        if self.sampler.is_stream:
            return {"pass": self.sampler.pass_state(), "loader": None, "questions": questions}
        iterator = self._iterator
        limit = self.epoch_batches() if self.epoch_batches is not None else math.inf
        finished = iterator is None or iterator._num_yielded >= min(len(iterator), limit)
        return {
            "pass": self.sampler.pass_state(finished),
            "loader": None if finished else super().state_dict(),
            "questions": questions,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the pass, and the position in it when it was not finished; a state saved over other
        training questions is a ValueError (a state without the record, saved before it was kept, is not)."""
        now = question_fingerprint(self.sampler.question_ids)
        check_same_questions(state_dict.get("questions"), now, self.source)
        if self.sampler.is_stream:
            state, saved = dict(state_dict["pass"]), state_dict["loader"]
            if "position" not in state and saved:  # saved by the plain sampler: its torchdata count
                state["position"] = int(saved.get("_sampler_iter_yielded", 0))
            self.sampler.restore_pass(state)
            self._restored = None
            super().load_state_dict({})
            return
        self.sampler.restore_pass(state_dict["pass"])
        self._restored = state_dict["loader"]
        super().load_state_dict(self._restored or {})

"""PromptDataModule: prompt/answer batches for GRPO, from files or the synthetic arithmetic task.

Questions can be retired (ExGRPO stops sampling questions every rollout already solves):
`exclude_questions(ids)` drops them from every training pass (epoch) that begins afterwards, and the
excluded ids travel in the datamodule's `state_dict`, so a resumed run keeps them retired. A hook given to
`add_pass_hook` runs right before each pass is drawn (`ReplayCallback` retires questions there); Lightning
draws the pass of epoch e >= 1 after `on_train_epoch_start`, so ids excluded in that hook leave epoch e too.

Every epoch has the same number of steps, on any number of ranks: the training sampler shards each pass
across ranks itself (Lightning leaves it unwrapped), retired questions never reappear, and their freed
slots are filled by seeing some remaining questions twice. So no collective waits on a rank that ran out,
and Lightning's epoch length (epoch-end validation, `max_epochs` schedules, the progress bar) stays right.
Call `exclude_questions` with the same ids on every rank; otherwise the ranks' shards overlap.

Resume: the training loader is a torchdata `StatefulDataLoader`; Lightning saves its state (the current
pass's seed, number and order, and how many batches were taken) in each checkpoint and restores it, so a
resumed run trains on exactly the batches the uninterrupted run would have, in every later epoch too.
Iterating the loader begins its passes; nothing in it draws from torch's global generator.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from exgrpo_pl.data.loading import check_answer_from, load_rows, split_rows
from exgrpo_pl.data.synthetic import ArithmeticTask
from exgrpo_pl.data.task import SyntheticTask
from exgrpo_pl.seeding import derive_seed, split_seed
from exgrpo_pl.validation import check_number

_FIXED_KEYS = ("id", "prompt", "answer", "domain")

# torchdata 0.11 calls torch.set_vital on every loader it builds and torch warns that the call is deprecated:
# a warning about torchdata's internals that a user can do nothing about, printed by every run.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class _RowDataset(Dataset):
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

    Args:
        question_ids: the question id of each dataset index.
        excluded: the excluded question ids; kept by reference, so later additions are seen.
        seed: seed of the shuffle.
        num_replicas: ranks that share the data.
        rank: this rank.
        start_rows: active rows when the run started, which sets the length of every pass; None: the active
            rows now.
    """

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


class _ResumableLoader(StatefulDataLoader):
    """A torchdata `StatefulDataLoader` over an `ExcludingRandomSampler` that begins a new pass of it when an
    epoch's iteration starts, and saves the pass's order with the position in it.

    Lightning saves the `state_dict` of a training loader that has one, with the loops, and loads it into
    the new run's loader before iterating it. A pass whose epoch is over (every batch taken, or as many as
    `epoch_batches()` says an epoch has: Lightning's `limit_train_batches`) is saved without position, so a
    run resumed from its end begins the next pass, as the uninterrupted run does. An iteration started again
    before it took a batch (Lightning does so on some resumes) goes over the same pass from the same place
    instead of beginning another.

    Args:
        args: `StatefulDataLoader`'s.
        epoch_batches: the most batches an epoch takes; None: no limit.
        before_pass: called right before each new pass is drawn.
        kwargs: `StatefulDataLoader`'s.
    """

    def __init__(
        self,
        *args: Any,
        epoch_batches: Callable[[], float] | None = None,
        before_pass: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_batches = epoch_batches
        self.before_pass = before_pass
        self._restored: dict[str, Any] | None = None  # the position loaded, until a batch is taken after it
        self._taken_at_start = 0

    def __iter__(self):
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
            left = len(self.sampler.order)
            if left < min(self.batch_size, self.sampler.start_rows):  # a batch would hold a question twice
                raise RuntimeError(
                    f"only {left} of {len(self.sampler.question_ids)} training questions"
                    f" are left (the others are retired), fewer than one batch of {self.batch_size}"
                    "; nothing is left to train on"
                )
        iterator = super().__iter__()
        self._taken_at_start = iterator._num_yielded
        return iterator

    def state_dict(self) -> dict[str, Any]:
        """`{"pass": the sampler's pass, "loader": torchdata's state, None at the end of the pass}`."""
        iterator = self._iterator
        limit = self.epoch_batches() if self.epoch_batches is not None else math.inf
        finished = iterator is None or iterator._num_yielded >= min(len(iterator), limit)
        return {
            "pass": self.sampler.pass_state(finished),
            "loader": None if finished else super().state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the pass, and the position in it when it was not finished."""
        self.sampler.restore_pass(state_dict["pass"])
        self._restored = state_dict["loader"]
        super().load_state_dict(self._restored or {})


class PromptDataModule(L.LightningDataModule):
    """Prompt/answer batches for GRPO training and validation.

    Training data is `train_path`, or the `synthetic` task when that is None. Validation data is `val_path`,
    or a deterministic `val_fraction` split of the training data when that is None.

    Args:
        train_path: training data file or saved-dataset directory (see `load_rows` for formats).
        val_path: validation data, same formats.
        synthetic: the synthetic task used when `train_path` is None; None means `ArithmeticTask()`.
        val_fraction: share of the training data held out for validation when `val_path` is None; 0
            disables validation.
        prompt_column: column holding the prompt.
        answer_column: column holding the reference answer.
        id_column: column holding a stable question id; None hashes the prompt text.
        domain_column: column holding the task/domain name.
        answer_from: "column" uses the answer column as it is; "boxed" takes the content of the last
            `\\boxed{...}` of a worked solution in it. The usual math layouts (see `load_rows`):
            prompt/answer: the defaults; problem/solution (MATH): `prompt_column="problem",
            answer_column="solution", answer_from="boxed"`; OpenR1-Math: `prompt_column="problem",
            answer_column="answer"` (its `solution` column reaches reward functions as a column).
        batch_size: prompts per training batch (each is expanded into a group of rollouts later).
        val_batch_size: prompts per validation batch; None means `batch_size`.
        num_workers: DataLoader worker processes.
        seed: seeds the training shuffle and the split of file data; None: the shuffle follows the run seed
            (`derive_seed("data")`, read when the training loader is built, so a later `seed_everything`
            counts) and the split uses seed 0, so the held-out rows never depend on the run seed.
        drop_last: drop the last incomplete training batch.
    """

    def __init__(
        self,
        train_path: str | None = None,
        val_path: str | None = None,
        synthetic: SyntheticTask | None = None,
        val_fraction: float = 0.1,
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        id_column: str | None = None,
        domain_column: str | None = None,
        answer_from: str = "column",
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int | None = None,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        check_number("PromptDataModule", "val_fraction", val_fraction, 0, 1, high_open=True)
        check_number("PromptDataModule", "batch_size", batch_size, 1, integer=True)
        check_number("PromptDataModule", "val_batch_size", val_batch_size, 1, integer=True, optional=True)
        check_number("PromptDataModule", "num_workers", num_workers, 0, integer=True)
        check_number("PromptDataModule", "seed", seed, integer=True, optional=True)
        check_answer_from(answer_from)
        # The task object stays out of the hyperparameters: checkpoints must load with weights_only=True.
        self.save_hyperparameters(ignore=["synthetic"])
        self.synthetic = synthetic
        self._excluded: set[int] = set()
        self._start_rows: int | None = None  # active training rows when the run's training began
        self._sampler: ExcludingRandomSampler | None = None  # the latest training loader's
        self._pass_hooks: list[Callable[[PromptDataModule], None]] = []
        self._train_rows: list[dict[str, Any]] | None = None
        self._val_rows: list[dict[str, Any]] = []

    def _load(self, path: str) -> list[dict[str, Any]]:
        hp = self.hparams
        return load_rows(
            path,
            hp.prompt_column,
            hp.answer_column,
            hp.id_column,
            hp.domain_column,
            answer_from=hp.answer_from,
        )

    def setup(self, stage: str | None = None) -> None:
        """Loads and validates the data (once, whatever the stage)."""
        if self._train_rows is not None:
            return
        hp = self.hparams
        if hp.train_path is not None:
            rows = self._load(hp.train_path)
            if hp.val_path is None:
                split_seed = hp.seed if hp.seed is not None else 0
                rows, self._val_rows = split_rows(rows, hp.val_fraction, seed=split_seed)
        else:
            task = self.synthetic if self.synthetic is not None else ArithmeticTask()
            if hp.val_path is None:
                rows, self._val_rows = task.split(hp.val_fraction)
            else:
                rows = task.rows()
        if hp.val_path is not None:
            self._val_rows = self._load(hp.val_path)
        if not rows:
            raise ValueError("no training rows are left after the validation split; lower val_fraction")
        self._train_rows = rows

    @property
    def train_rows(self) -> list[dict[str, Any]]:
        """The training rows (after `setup`)."""
        if self._train_rows is None:
            raise RuntimeError("PromptDataModule.setup() has not run yet")
        return self._train_rows

    @property
    def val_rows(self) -> list[dict[str, Any]]:
        """The validation rows (after `setup`); empty when validation is disabled."""
        return self._val_rows

    @property
    def excluded_question_ids(self) -> frozenset[int]:
        """The retired question ids."""
        return frozenset(self._excluded)

    def exclude_questions(self, ids: Iterable[int]) -> None:
        """Sets the retired questions: training epochs that start afterwards skip them, and questions
        excluded before but not in `ids` return (re-admitted).

        Args:
            ids: question ids (ints or 0-d tensors), every question to leave out from now on.
        """
        ids = {int(qid) for qid in ids}
        self._excluded.clear()  # in place: the training sampler holds a reference to this set
        self._excluded.update(ids)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches that skip retired questions, sharded across the trainer's ranks, with
        their pass and position in Lightning's checkpoints (a `StatefulDataLoader`)."""
        rows, hp = self.train_rows, self.hparams
        num_replicas, rank = self._replicas()
        seed = hp.seed if hp.seed is not None else derive_seed("data")
        sampler = ExcludingRandomSampler(
            [row["id"] for row in rows], self._excluded, seed, num_replicas, rank, self._start_rows
        )
        if self._sampler is not None:  # a reloaded loader goes on counting passes
            sampler.epoch = self._sampler.epoch
        self._sampler, self._start_rows = sampler, sampler.start_rows
        if hp.drop_last and 0 < len(sampler) < hp.batch_size:  # none active: iterating says all are retired
            split = self._val_rows and hp.val_path is None
            held_out = f" after {len(self._val_rows)} held out for validation" if split else ""
            retired = len(rows) - sampler.start_rows
            retired = f", {retired} of them retired" if retired else ""
            per_rank = f" ({len(sampler)} per rank on {num_replicas} ranks)" if num_replicas > 1 else ""
            raise ValueError(
                f"{self._source()} has {len(rows)} training rows{held_out}{retired}{per_rank}, fewer than"
                f" one training batch of batch_size={hp.batch_size} (drop_last=True): training would take no"
                " step. Lower batch_size, add rows, lower val_fraction, or set drop_last=False."
            )
        return _ResumableLoader(
            _RowDataset(rows),
            batch_size=hp.batch_size,
            sampler=sampler,
            collate_fn=collate_rows,
            num_workers=hp.num_workers,
            drop_last=hp.drop_last,
            # Its own generator: starting an iterator (each epoch) then draws nothing from torch's global one,
            # which samples the rollouts and which a resumed run restores just before.
            generator=torch.Generator().manual_seed(seed),
            epoch_batches=self._epoch_batches,
            before_pass=self._before_pass,
        )

    def add_pass_hook(self, hook: Callable[[PromptDataModule], None]) -> None:
        """Calls `hook(datamodule)` right before each training pass (epoch) is drawn, from then on.

        Every rank calls it at the same point, so it may use collectives. `ReplayCallback` retires questions
        through it: a pass is drawn at each epoch's start, and also when a run resumed from an epoch's end
        sets its data up (before any epoch hook), so exclusions made here reach exactly the passes they
        would have reached in the uninterrupted run. Adding the same hook again does nothing.

        Args:
            hook: called with this datamodule.
        """
        if hook not in self._pass_hooks:
            self._pass_hooks.append(hook)

    def _before_pass(self) -> None:
        for hook in self._pass_hooks:
            hook(self)

    def _epoch_batches(self) -> float:
        """Batches per training epoch as the trainer counts them (`limit_train_batches` applied)."""
        return self.trainer.num_training_batches if self.trainer is not None else math.inf

    def _replicas(self) -> tuple[int, int]:
        """(ranks sharing the training data, this rank), from the trainer's strategy; (1, 0) without one."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def _source(self) -> str:
        hp = self.hparams
        if hp.train_path is not None:
            return f"train_path {hp.train_path!r}"
        task = self.synthetic if self.synthetic is not None else ArithmeticTask()
        return f"the synthetic task {task!r}"

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in file order; an empty list (no validation) when there are no rows."""
        if not self._val_rows:
            return []
        return DataLoader(
            _RowDataset(self._val_rows),
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            collate_fn=collate_rows,
            num_workers=self.hparams.num_workers,
            # Its own generator: starting to iterate (each validation) then draws nothing from torch's global
            # one, which samples the training rollouts.
            generator=torch.Generator().manual_seed(0),
        )

    def test_dataloader(self) -> DataLoader | list:
        """The held-out split again: `exgrpo test` reports pass@1 on it (there is no separate test file)."""
        return self.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        """The retired question ids (a sorted list of ints) and the active rows when training began.

        The training loader's pass and position are saved by Lightning with the loops (`_ResumableLoader`).
        """
        return {"excluded_question_ids": sorted(self._excluded), "start_rows": self._start_rows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the retired question ids (the sampler sees them from its next pass) and the length the
        training loader reports before its first pass, which Lightning measures as the epoch length."""
        # In place: the training sampler holds a reference to this set.
        self._excluded.clear()
        self._excluded.update(int(qid) for qid in state_dict["excluded_question_ids"])
        self._start_rows = state_dict.get("start_rows")

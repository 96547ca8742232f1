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

Deferred questions: after `stream_passes()` (`ReplayCallback(displaced_questions="defer")` calls it),
training batches are one stream of passes that goes on across epochs (`exgrpo_pl.data.stream`), and
`defer_questions(ids)` hands the questions a step left out out again first.

Resume: the training loader is a torchdata `StatefulDataLoader`; Lightning saves its state (the current
pass's seed, number and order, and how many batches were taken) in each checkpoint and restores it, so a
resumed run trains on exactly the batches the uninterrupted run would have, in every later epoch too.
Iterating the loader begins its passes; nothing in it draws from torch's global generator. The sampler and
the loader are in `exgrpo_pl.data.loaders`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from exgrpo_pl.data.eval_sets import COLUMN_OPTIONS, EvalSet, check_names, eval_rows
from exgrpo_pl.data.loaders import ExcludingRandomSampler, ResumableLoader, RowDataset, collate_rows
from exgrpo_pl.data.loading import check_answer_from, find_row, load_rows, split_rows
from exgrpo_pl.data.stream import PassStream, StreamedPasses
from exgrpo_pl.data.synthetic import ArithmeticTask
from exgrpo_pl.data.task import SyntheticTask
from exgrpo_pl.seeding import derive_seed
from exgrpo_pl.validation import check_number

# ExcludingRandomSampler and collate_rows (exgrpo_pl.data.loaders) are importable from here too.
__all__ = ["ExcludingRandomSampler", "PromptDataModule", "collate_rows"]


class PromptDataModule(StreamedPasses, L.LightningDataModule):
    """Prompt/answer batches for GRPO training and validation.

    Training data is `train_path`, or the `synthetic` task when that is None. Validation data is `val_path`,
    or a deterministic `val_fraction` split of the training data when that is None.

    Args:
        train_path: training data file or saved-dataset directory (see `load_rows` for formats).
        val_path: validation data, same formats.
        synthetic: the synthetic task used when `train_path` is None; None means `ArithmeticTask()`.
        val_fraction: share of the training data held out for validation when `val_path` is None; 0
            disables validation.
        prompt_column: column holding the prompt: text, or a list of chat messages (`role`, `content`),
            kept as that list. Every `*_column` is a column name or a dotted path into nested objects,
            e.g. `"reward_model.ground_truth"`.
        answer_column: column holding the reference answer.
        id_column: column holding a stable question id; None hashes the prompt (a message list as a
            canonical JSON).
        domain_column: column holding the task/domain name, e.g. verl's `data_source`.
        answer_from: "column" uses the answer column as it is; "boxed" takes the content of the last
            `\\boxed{...}` of a worked solution in it. The usual math layouts (see `load_rows`):
            prompt/answer: the defaults; problem/solution (MATH): `prompt_column="problem",
            answer_column="solution", answer_from="boxed"`; OpenR1-Math: `prompt_column="problem",
            answer_column="answer"` (its `solution` column reaches reward functions as a column); verl,
            the paper's: `answer_column="reward_model.ground_truth", domain_column="data_source",
            drop_system_prompt=True`.
        drop_system_prompt: drop the leading system messages of message-list prompts, as the paper's
            evaluation does; text prompts are unchanged.
        batch_size: prompts per training batch (each is expanded into a group of rollouts later).
        val_batch_size: prompts per validation batch; None means `batch_size`.
        num_workers: DataLoader worker processes.
        seed: seeds the training shuffle and the split of file data; None: the shuffle follows the run seed
            (`derive_seed("data")`, read when the training loader is built, so a later `seed_everything`
            counts) and the split uses seed 0, so the held-out rows never depend on the run seed.
        drop_last: drop the last incomplete training batch.
        eval_sets: named evaluation sets, name -> `EvalSet` (a file, a synthetic task, or this module's
            validation rows), each validated and reported on its own with the paper's metrics besides the
            plain validation pass@1; see `exgrpo_pl.data.eval_sets`.
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
        drop_system_prompt: bool = False,
        batch_size: int = 8,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int | None = None,
        drop_last: bool = True,
        eval_sets: dict[str, EvalSet] | None = None,
    ) -> None:
        super().__init__()
        check_number("PromptDataModule", "val_fraction", val_fraction, 0, 1, high_open=True)
        check_number("PromptDataModule", "batch_size", batch_size, 1, integer=True)
        check_number("PromptDataModule", "val_batch_size", val_batch_size, 1, integer=True, optional=True)
        check_number("PromptDataModule", "num_workers", num_workers, 0, integer=True)
        check_number("PromptDataModule", "seed", seed, integer=True, optional=True)
        check_answer_from(answer_from)
        check_names(eval_sets or {})
        # Objects stay out of the hyperparameters: checkpoints must load with weights_only=True.
        self.save_hyperparameters(ignore=["synthetic", "eval_sets"])
        self.synthetic = synthetic
        self.eval_sets = dict(eval_sets or {})
        self._eval_rows: dict[str, list[dict[str, Any]]] = {}
        self._excluded: set[int] = set()
        self._start_rows: int | None = None  # active training rows when the run's training began
        self._sampler: ExcludingRandomSampler | None = None  # the latest training loader's
        self._pass_hooks: list[Callable[[PromptDataModule], None]] = []
        self._streaming = False  # stream_passes()
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
            drop_system_prompt=hp.drop_system_prompt,
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
        defaults = {key: hp[key] for key in COLUMN_OPTIONS}
        self._eval_rows = {
            name: eval_rows(name, spec, defaults, lambda: self._val_rows)
            for name, spec in self.eval_sets.items()
        }
        self._train_rows = rows

    def locate(self, row: dict[str, Any]) -> str:
        """Where a loaded row comes from, for error messages: `"<file>: line 3"` (the training file, the
        validation file or an evaluation set's file, the first that has it), or the synthetic task."""
        hp = self.hparams
        sources = [(hp.train_path, hp.prompt_column, hp.drop_system_prompt)]
        sources.append((hp.val_path, hp.prompt_column, hp.drop_system_prompt))
        for spec in self.eval_sets.values():
            column = spec.prompt_column or hp.prompt_column
            drop = hp.drop_system_prompt if spec.drop_system_prompt is None else spec.drop_system_prompt
            sources.append((spec.path, column, drop))
        for path, column, drop in sources:
            if path is None:
                continue
            position = find_row(path, column, row["prompt"], drop)
            if position is not None:
                return f"{path}: {position}"
        task = self.synthetic if self.synthetic is not None else ArithmeticTask()
        return f"synthetic task {type(task).__name__}"

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
    def eval_rows(self) -> dict[str, list[dict[str, Any]]]:
        """The named evaluation sets' rows (after `setup`), each with `num_samples`."""
        return self._eval_rows

    @property
    def val_set_names(self) -> list[str | None]:
        """The set of each validation loader, in order: None for the plain validation set (when it has rows),
        then the named evaluation sets."""
        return ([None] if self._val_rows else []) + list(self._eval_rows)

    @property
    def out_of_distribution_sets(self) -> set[str]:
        """The named sets that count towards the out-of-distribution average."""
        return {name for name, spec in self.eval_sets.items() if spec.out_of_distribution}

    @property
    def sets_averaged_by_domain(self) -> set[str]:
        """The named sets whose domains count as benchmarks of their own in the averages."""
        return {name for name, spec in self.eval_sets.items() if spec.average_by_domain}

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
        their pass and position in Lightning's checkpoints (a `StatefulDataLoader`); after `stream_passes()`,
        taken from one stream of passes that every training loader of this datamodule shares."""
        rows, hp = self.train_rows, self.hparams
        num_replicas, rank = self._replicas()
        seed = hp.seed if hp.seed is not None else derive_seed("data")
        kept = self._sampler
        same = kept is not None and (kept.num_replicas, kept.rank, kept.start_rows) == (
            num_replicas, rank, self._start_rows,
        )  # fmt: skip
        if self._streaming and isinstance(kept, PassStream) and same:
            sampler = kept  # one stream: a loader built again (or counted and dropped) goes on with it
        else:
            ids, stream = [row["id"] for row in rows], {}
            if self._streaming:
                stream = dict(batch_size=hp.batch_size, drop_last=hp.drop_last, before_pass=self._before_pass)
            make = PassStream if self._streaming else ExcludingRandomSampler
            sampler = make(ids, self._excluded, seed, num_replicas, rank, self._start_rows, **stream)
            if kept is not None:  # a reloaded loader goes on counting passes
                sampler.epoch = kept.epoch
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
        return ResumableLoader(
            RowDataset(rows),
            batch_size=hp.batch_size,
            sampler=sampler,
            collate_fn=collate_rows,
            num_workers=0 if self._streaming else hp.num_workers,
            drop_last=hp.drop_last,
            # Its own generator: starting an iterator (each epoch) then draws nothing from torch's global one,
            # which samples the rollouts and which a resumed run restores just before.
            generator=torch.Generator().manual_seed(seed),
            epoch_batches=self._epoch_batches,
            before_pass=self._before_pass,
            source=self._source(),
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
        """Validation batches in file order: the plain validation set's loader alone, or with named evaluation
        sets a list of loaders in `val_set_names` order; an empty list (no validation) when there are no
        rows."""
        rows = [self._val_rows] if self._val_rows else []
        loaders = [self._loader(part) for part in rows + list(self._eval_rows.values())]
        if not self._eval_rows:
            return loaders[0] if loaders else []
        return loaders

    def _loader(self, rows: list[dict[str, Any]]) -> DataLoader:
        return DataLoader(
            RowDataset(rows),
            batch_size=self.hparams.val_batch_size or self.hparams.batch_size,
            shuffle=False,
            collate_fn=collate_rows,
            num_workers=self.hparams.num_workers,
            # Its own generator: starting to iterate (each validation) then draws nothing from torch's global
            # one, which samples the training rollouts.
            generator=torch.Generator().manual_seed(0),
        )

    def test_dataloader(self) -> DataLoader | list:
        """The validation loaders again: `exgrpo test` reports pass@1 on the held-out split and the paper's
        metrics on the named evaluation sets."""
        return self.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        """The retired question ids (a sorted list of ints) and the active rows when training began.

        The training loader's pass and position are saved by Lightning with the loops (`ResumableLoader`).
        """
        return {"excluded_question_ids": sorted(self._excluded), "start_rows": self._start_rows}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the retired question ids (the sampler sees them from its next pass) and the length the
        training loader reports before its first pass, which Lightning measures as the epoch length."""
        # In place: the training sampler holds a reference to this set.
        self._excluded.clear()
        self._excluded.update(int(qid) for qid in state_dict["excluded_question_ids"])
        self._start_rows = state_dict.get("start_rows")

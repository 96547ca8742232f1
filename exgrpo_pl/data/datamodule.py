"""PromptDataModule: prompt/answer batches for GRPO, from files or the synthetic arithmetic task.

Questions can be retired (ExGRPO stops sampling questions every rollout already solves):
`exclude_questions(ids)` drops them from every training epoch whose data iteration starts afterwards, and
the excluded ids travel in the datamodule's `state_dict`, so a resumed run keeps them retired. Lightning
starts iterating epoch e >= 1 after `on_train_epoch_start`, so ids excluded in that hook already leave
epoch e; epoch 0's iterator is made before the hook.

Under DDP, Lightning wraps the training sampler in a `DistributedSamplerWrapper`. That wrapper fixes its
per-rank length when it is built and, each epoch, lists this sampler afresh and pads the (now shorter) list
with repeats of its first entries up to that length. So retired questions never reappear, every rank runs
the same number of steps (no collective waits on a rank that ran out), and the freed slots are filled by
seeing some remaining questions twice. Call `exclude_questions` with the same ids on every rank; otherwise
the ranks' shards overlap.

On a single device the epoch simply gets shorter; the progress bar keeps the length it measured at the
start of training.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Set
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from exgrpo_pl.data.loading import check_answer_from, load_rows, split_rows
from exgrpo_pl.data.synthetic import ArithmeticTask
from exgrpo_pl.data.task import SyntheticTask

_FIXED_KEYS = ("id", "prompt", "answer", "domain")


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


class ExcludingRandomSampler(Sampler[int]):
    """Shuffles dataset indices each epoch, skipping the rows whose question id is excluded.

    The excluded set is read at the start of each epoch, so ids added to it take effect from the next one.
    The order of epoch `e` comes from a generator seeded with `seed + e`; `e` is whatever `set_epoch` set
    last (Lightning calls it before each epoch) and advances by one after each pass otherwise.

    Args:
        question_ids: the question id of each dataset index.
        excluded: the excluded question ids; kept by reference, so later additions are seen.
        seed: base seed of the shuffle.
    """

    def __init__(self, question_ids: Sequence[int], excluded: Set[int], seed: int = 0) -> None:
        self.question_ids = list(question_ids)
        self.excluded = excluded
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next pass draws."""
        self.epoch = epoch

    def _active(self) -> list[int]:
        return [index for index, qid in enumerate(self.question_ids) if qid not in self.excluded]

    def __len__(self) -> int:
        return len(self._active())

    def __iter__(self) -> Iterator[int]:
        active = self._active()
        if not active:
            raise RuntimeError(
                f"all {len(self.question_ids)} training questions are retired; nothing is left to train on"
            )
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(active), generator=generator).tolist()
        return iter([active[i] for i in order])


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
        seed: seeds the training shuffle and the split of file data.
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
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1 or (val_batch_size is not None and val_batch_size < 1):
            raise ValueError(f"batch sizes must be >= 1, got {batch_size} and {val_batch_size}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        check_answer_from(answer_from)
        # The task object stays out of the hyperparameters: checkpoints must load with weights_only=True.
        self.save_hyperparameters(ignore=["synthetic"])
        self.synthetic = synthetic
        self._excluded: set[int] = set()
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
                rows, self._val_rows = split_rows(rows, hp.val_fraction, seed=hp.seed)
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
        """Retires questions: training epochs that start afterwards skip them.

        Args:
            ids: question ids (ints or 0-d tensors).
        """
        self._excluded.update(int(qid) for qid in ids)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches that skip retired questions."""
        rows = self.train_rows
        sampler = ExcludingRandomSampler([row["id"] for row in rows], self._excluded, seed=self.hparams.seed)
        return DataLoader(
            _RowDataset(rows),
            batch_size=self.hparams.batch_size,
            sampler=sampler,
            collate_fn=collate_rows,
            num_workers=self.hparams.num_workers,
            drop_last=self.hparams.drop_last,
        )

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
        """The retired question ids, as a sorted list of ints."""
        return {"excluded_question_ids": sorted(self._excluded)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the retired question ids; the sampler sees them from its next epoch."""
        # In place: the training sampler holds a reference to this set.
        self._excluded.clear()
        self._excluded.update(int(qid) for qid in state_dict["excluded_question_ids"])

"""The training sampler of a run whose replay steps defer the fresh questions they displace
(`ReplayCallback(displaced_questions="defer")`): `ExcludingRandomSampler`'s passes handed out as one endless
stream, whose position moves on only by the questions that were trained on (`PassStream`). Used by
`PromptDataModule` once `stream_passes()` is called (`exgrpo_pl.data.datamodule`): for deferred questions,
and for dynamic sampling (`ExGRPOModule(dynamic_sampling=...)`), whose further questions a step takes from
the stream (`take`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from exgrpo_pl.data.loaders import ExcludingRandomSampler, check_enough_left, collate_rows


class PassStream(ExcludingRandomSampler):
    """The passes of `ExcludingRandomSampler` (the same orders, retirement, sharding and padding), as one
    endless stream with a position that only what was trained on moves on.

    Iterating yields this rank's share of the current pass from `position` on; once that is used up, the next
    pass is drawn (`before_pass()`, then `begin_pass()`, right before its first question is needed) and the
    stream goes on with it. Every iterator goes on from the stream's position and yields one epoch's worth,
    the questions of the loader's `len()` full batches, so an epoch (Lightning's `num_training_batches`
    batches) that ends mid-pass leaves the rest of the pass to the next epoch instead of abandoning it.
    Batches run on across pass boundaries, always full (the last batch of a pass may finish with the next
    pass's first questions).

    `rewind(question_ids)` moves the position back over the last questions handed out, which a step left
    out: the next batch starts with them, in their order, and the stream then goes on as before. So every
    question of a pass is trained on once, and a pass takes as many more questions' worth of batches as were
    rewound. A rewind may reach back into the previous pass (a batch that straddled two); the pass already
    drawn is then not drawn again, and the rewound questions come back although a retirement at that pass's
    draw may have excluded them since: they belong to the pass they were drawn in, as every question of a
    running pass does (exclusions reach the passes drawn after them).

    The state (`pass_state` / `restore_pass`) is the current pass's order, the previous one's while the
    position is back in it, and the position. It is the same on every rank as long as every rank rewinds as
    many questions at the same steps (`ReplayCallback` makes them), so the copy that rank 0 writes into a
    checkpoint restores every rank.

    Args:
        args: `ExcludingRandomSampler`'s.
        batch_size: questions per batch: drawing a pass with fewer active questions is an error, as
            `ResumableLoader` makes it for the plain sampler.
        drop_last: whether the loader's `len()` leaves out a last incomplete batch, as the DataLoader's.
        before_pass: called right before each pass is drawn (the datamodule's pass hooks).
        kwargs: `ExcludingRandomSampler`'s.
    """

    is_stream = True

    def __init__(
        self,
        *args: Any,
        batch_size: int = 1,
        drop_last: bool = True,
        before_pass: Callable[[], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        batches = self.num_samples // batch_size if drop_last else math.ceil(self.num_samples / batch_size)
        self.epoch_length = batches * batch_size  # questions an iterator yields
        self.before_pass = before_pass
        self.previous: list[int] | None = None  # the pass before the current one (global order)
        # Entries of this rank's share of the current pass handed out and not rewound; negative: that many
        # of the previous pass's share are still to come first.
        self.position = 0
        self.furthest = 0  # the furthest position handed out: furthest - position questions wait
        self._share: list[int] = []
        self._previous_share: list[int] = []

    def _share_of(self, order: list[int]) -> list[int]:
        repeats = math.ceil(self.total_size / len(order))
        return (order * repeats)[: self.total_size][self.rank :: self.num_replicas]

    def _next_pass(self) -> None:
        previous = self.order
        if self.before_pass is not None:
            self.before_pass()
        self.begin_pass()
        check_enough_left(self, self.batch_size)
        self.previous, self.position, self.furthest = previous, 0, 0
        self._cache_shares()

    def _cache_shares(self) -> None:
        self._share = self._share_of(self.order) if self.order is not None else []
        self._previous_share = self._share_of(self.previous) if self.previous is not None else []

    def _at(self, position: int) -> int:
        """The dataset index at `position` (negative: in the previous pass's share, counted from its end)."""
        return self._share[position] if position >= 0 else self._previous_share[position]

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.epoch_length):
            yield self._hand_out()

    def _hand_out(self) -> int:
        """The dataset index at the position, which moves on by one (drawing the next pass when needed)."""
        if self.order is None or self.position >= self.num_samples:
            self._next_pass()
        index = self._at(self.position)
        self.position += 1
        self.furthest = max(self.furthest, self.position)
        return index

    def take(self, n: int) -> list[int]:
        """Hands the next `n` questions of the stream out to a step besides its batch (dynamic sampling's
        further questions): they count as handed out, so the next batch goes on after them, and a resumed
        run's stream is where the uninterrupted run's was. Every rank must take as many at the same steps
        (the stream's state is rank 0's copy)."""
        return [self._hand_out() for _ in range(n)]

    @property
    def waiting(self) -> int:
        """Questions rewound and not handed out again yet."""
        return self.furthest - self.position

    def rewind(self, question_ids: Sequence[int]) -> None:
        """Hands the last `len(question_ids)` questions out again next, before the rest of the stream.

        Args:
            question_ids: the ids of the last questions handed out, in the order they were: a step leaves
                out the last ones of its batch.

        Raises:
            ValueError: when they are not the last questions handed out, or reach back further than the
                previous pass.
        """
        wanted = [int(qid) for qid in question_ids]
        start = self.position - len(wanted)
        earliest = -len(self._previous_share)
        if start < earliest:
            raise ValueError(
                f"cannot defer {len(wanted)} questions: only {self.position - earliest} were handed out since"
                " the previous pass began"
            )
        handed = [self.question_ids[self._at(p)] for p in range(start, self.position)]
        if handed != wanted:
            raise ValueError(
                f"defer_questions got question ids {wanted}, but the last {len(wanted)} questions handed"
                f" out are {handed}: only the questions a training batch ends with can be deferred (a mixed"
                " replay step leaves out its batch's last ones), before the next batch is taken"
            )
        self.position = start

    def pass_state(self, finished: bool = False) -> dict[str, Any]:
        """The stream's state, whatever `finished` says: the current pass's seed, number and order, the
        previous pass's order while the position is back in it, the position and the furthest one."""
        state = super().pass_state(False)
        back = self.position < 0 and self.previous is not None
        state["previous"] = torch.tensor(self.previous, dtype=torch.long) if back else None
        state["position"], state["furthest"] = self.position, self.furthest
        return state

    def restore_pass(self, state: dict[str, Any]) -> None:
        """Makes the saved stream current. A state saved by the plain sampler (no `position`) has one only
        where the caller adds it; without, its pass starts from the beginning, and a finished one (no order)
        is followed by the next pass."""
        super().restore_pass(state)
        previous = state.get("previous")
        self.previous = None if previous is None else previous.tolist()
        self.position = int(state.get("position", 0))
        self.furthest = int(state.get("furthest", self.position))
        self._cache_shares()


class StreamedPasses:
    """What `PromptDataModule` does with its training stream (a mixin of it): turn it on
    (`stream_passes`), hand a step's left-out questions back to it (`defer_questions`), and take further
    questions from it for a step (`draw_questions`). Uses the datamodule's `_streaming` flag, its latest
    training sampler `_sampler` and its `train_rows`."""

    def stream_passes(self) -> None:
        """Makes the training batches one stream of passes from the next training loader on, for
        `defer_questions` (`ReplayCallback(displaced_questions="defer")` calls it at setup) and
        `draw_questions` (`ExGRPOModule(dynamic_sampling=...)` calls it at setup).

        An epoch (Lightning's `num_training_batches` batches) then goes on with the pass the last one left
        unfinished; the next pass, with the pass hooks, is drawn when its first question is needed. Every
        training loader built afterwards takes its batches from that stream, in this process (workers would
        fetch ahead of the steps): `num_workers` then applies to the validation loaders only.
        """
        if not self._streaming and self.hparams.num_workers > 0:
            rank_zero_warn(
                f"PromptDataModule num_workers={self.hparams.num_workers}: with deferred questions"
                " (ReplayCallback displaced_questions='defer') or dynamic sampling (ExGRPOModule"
                " dynamic_sampling) the training batches are taken in this process, since workers would"
                " fetch them ahead of the steps that move the stream; the validation loaders keep their"
                " workers"
            )
        self._streaming = True

    def _stream(self, what: str) -> PassStream:
        if not self._streaming or not isinstance(self._sampler, PassStream):
            raise RuntimeError(
                f"{what} needs a stream of passes: call stream_passes() before the training loader is built"
                " (ReplayCallback(displaced_questions='defer') and ExGRPOModule(dynamic_sampling=...) do so"
                " at setup)"
            )
        return self._sampler

    def defer_questions(self, ids: Iterable[int]) -> None:
        """Hands the questions a step left out out again first: `ids` are the last questions of the latest
        training batch (a mixed replay step leaves out its batch's last ones), in their order; the next batch
        starts with them, and the stream then goes on where it was. Needs `stream_passes()`.

        Args:
            ids: question ids (ints or 0-d tensors), the last `len(ids)` of the latest batch; else ValueError.
        """
        self._stream("defer_questions").rewind([int(qid) for qid in ids])

    def draw_questions(self, n: int) -> dict[str, Any]:
        """The next `n` questions of the training stream as a training batch (`collate_rows`), for a step
        that samples more than its batch (dynamic sampling). They count as handed out: the next batch goes
        on after them, and checkpoints save the stream's position with them. Call it with the same `n` on
        every rank at the same steps. Needs `stream_passes()`."""
        indices = self._stream("draw_questions").take(n)
        rows = self.train_rows
        return collate_rows([rows[index] for index in indices])

    @property
    def deferred_waiting(self) -> int:
        """Questions handed back by `defer_questions` and not taken by a batch yet."""
        return self._sampler.waiting if isinstance(self._sampler, PassStream) else 0

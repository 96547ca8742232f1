"""DifficultyMonitor: draws the replay buffer in TensorBoard (difficulty tiers, entropy, age, retirements).

It reads the `TrajectoryBuffer` and `DifficultyBucketer` of the trainer's `ReplayCallback`; list it after
that callback so each step's statistics include the step's own rollouts:

    trainer = Trainer(
        logger=TensorBoardLogger("logs"),
        callbacks=[ReplayCallback(), DifficultyMonitor(log_every_n_steps=50)],
    )

Scalars go to every logger; histograms, the heatmap image and the completion table need a TensorBoardLogger.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import image as image_summary
from typing_extensions import override

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.callbacks.heatmap import draw_heatmap, heatmap_counts, nice_ceiling
from exgrpo_pl.callbacks.replay import ReplayCallback
from exgrpo_pl.experience.difficulty import tier_of
from exgrpo_pl.lightning_internals import batches_that_stepped
from exgrpo_pl.validation import check_number

HEATMAP_TAG = "monitor/difficulty_entropy_heatmap"
ENTROPY_BINS = 10  # rows of the difficulty x entropy heatmap
_NO_MATPLOTLIB = (
    "DifficultyMonitor: the heatmap (monitor/difficulty_entropy_heatmap) is drawn with matplotlib, which is "
    "not installed; `pip install 'exgrpo-pl[viz]'` adds it. The other statistics are logged without it"
)
_MAX_CELL_CHARS = 300  # completion-table cells are cut to this many characters


class DifficultyMonitor(Callback):
    """Logs what the replay buffer holds: how hard its questions are, how sure and how old its trajectories.

    Every `log_every_n_steps` training batches it logs, pooled over all ranks (every rank gathers, global
    rank 0 writes), at step n after the run's n-th batch: the loggers' axis, on which the module's `train/*`
    metrics of that batch sit one step earlier. With one optimizer update a batch n is `trainer.global_step`;
    with several (`steps_per_generation`, `num_iterations`) `global_step` counts the updates, and charts on
    it would run ahead of every other.

    - histograms `monitor/correctness_rate` (windowed correctness rate of every known question, retired ones
      included), `monitor/entropy` (mean token entropy of each buffered trajectory at collection),
      `monitor/staleness` (`global_step - policy_version` of each buffered trajectory, in optimizer
      updates) and, with more than one domain, `monitor/correctness_rate/<domain>` (the domain's
      non-retired questions);
    - scalars `monitor/questions_by_tier_{i}` (known questions per difficulty tier),
      `monitor/entropy_p{p}` (the `p`-th percentile of the pooled entropies, for each of the buffer's
      `entropy_percentiles`: the edges of the entropy bands that selection reads), `monitor/retired`
      (distinct retired questions) and `monitor/buffer_size`;
    - the image `monitor/difficulty_entropy_heatmap`: the buffered trajectories counted by their question's
      tier (x, hardest left) and their entropy (y, `ENTROPY_BINS` equal bins, lowest at the bottom), and
      beside them the replayed rows trained on since the last picture, counted alike; with tick labels,
      each cell's count and one colour bar, drawn with matplotlib (`callbacks/heatmap.py`; without
      matplotlib it warns once and logs the rest). The bins and the colour scale stay as the run's first
      picture set them (entropy from 0 to a round number above 1.25 times the first picture's highest,
      higher ones in the top row; counts from 1 to the buffers' `max_size`, logarithmic), so that colours
      and rows mean the same at every step; a resumed run sets them anew.

    Every `completion_table_every_n_steps` steps it logs `monitor/completions`, a Markdown table of
    `completion_samples` random rows of global rank 0's latest rollouts, up to half of them replayed ones
    where the step had any (marked in its `replayed` column).

    Scalars go to every logger; histograms, images and text only to TensorBoard loggers (with none, it warns
    once). Without a `ReplayCallback` (which holds the buffer and the bucketer) it warns once and logs only
    the completion table. Steps that log nothing cost a modulo and a reference; statistics are computed
    only on logging steps. Under DDP a question seen on several ranks counts once in the tiers (its rates
    averaged), but may count once per rank in the per-domain histograms.

    Args:
        log_every_n_steps: training batches between two rounds of buffer statistics, >= 1.
        num_tiers: equal-width correctness-rate tiers (`monitor/questions_by_tier_{i}`, the heatmap), >= 1.
        completion_table_every_n_steps: training batches between two completion tables; 0 disables them.
        completion_samples: rows per completion table, >= 1.
    """

    def __init__(
        self,
        log_every_n_steps: int = 50,
        num_tiers: int = 5,
        completion_table_every_n_steps: int = 100,
        completion_samples: int = 8,
    ) -> None:
        check_number("DifficultyMonitor", "log_every_n_steps", log_every_n_steps, 1, integer=True)
        check_number("DifficultyMonitor", "num_tiers", num_tiers, 1, integer=True)
        every = completion_table_every_n_steps
        check_number("DifficultyMonitor", "completion_table_every_n_steps", every, 0, integer=True)
        check_number("DifficultyMonitor", "completion_samples", completion_samples, 1, integer=True)
        self.log_every_n_steps = log_every_n_steps
        self.num_tiers = num_tiers
        self.completion_table_every_n_steps = completion_table_every_n_steps
        self.completion_samples = completion_samples
        self._replay: ReplayCallback | None = None
        self._latest: RolloutBatch | None = None
        self._last_stats_step = -1
        self._last_table_step = -1
        self._warned: set[str] = set()
        self._can_draw = False  # setup() decides: a TensorBoard logger, a buffer, matplotlib
        self._rng = np.random.default_rng(0)  # private: sampling table rows must not move training's RNG
        self._replayed: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # (question ids, entropy) since a picture
        self._entropy_top: float | None = None  # the heatmap's top entropy edge, set by its first picture

    # ---------------------------------------------------------------------------------------- hooks
    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        replays = [c for c in trainer.callbacks if isinstance(c, ReplayCallback)]
        self._replay = replays[0] if replays else None
        if stage != "fit":
            return
        if self._replay is None:
            self._warn_once(
                "no_replay",
                "DifficultyMonitor: no ReplayCallback among the trainer's callbacks; the buffer and the "
                "bucketer live there, so only the completion table is logged",
            )
        writers = _tensorboard_writers(trainer)
        self._can_draw = bool(writers) and self._replay is not None and _has_matplotlib()
        if writers and self._replay is not None and not self._can_draw:
            self._warn_once("no_matplotlib", _NO_MATPLOTLIB)
        if trainer.loggers and not writers:
            self._warn_once(
                "no_tensorboard",
                "DifficultyMonitor: histograms, images and text need a TensorBoardLogger; with the loggers "
                f"given ({', '.join(type(lg).__name__ for lg in trainer.loggers)}) only scalars are logged",
            )

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if isinstance(outputs, Mapping) and isinstance(outputs.get("rollouts"), RolloutBatch):
            self._latest = rollouts = outputs["rollouts"]
            if self._can_draw and bool(rollouts.replayed.any()):  # the heatmap's right panel
                rows = rollouts.replayed
                self._replayed.append(
                    (rollouts.question_ids[rows].cpu(), rollouts.entropy[rows].detach().cpu())
                )
        if not trainer.loggers:
            return
        # The batch count is the same on every rank, so every rank enters the collective below together; the
        # last-step guards keep gradient-accumulation micro-batches from logging one step twice.
        step = batches_that_stepped(trainer) + 1
        if self._replay is not None and step % self.log_every_n_steps == 0 and step != self._last_stats_step:
            self._last_stats_step = step
            self._log_statistics(trainer, step)
        every = self.completion_table_every_n_steps
        if every and step % every == 0 and step != self._last_table_step:
            self._last_table_step = step
            if trainer.is_global_zero and self._latest is not None:
                self._log_completions(trainer, self._latest, step)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._latest = None  # do not keep the last batch's tensors alive after fit

    # -------------------------------------------------------------------------------- statistics
    def _log_statistics(self, trainer: Trainer, step: int) -> None:
        """Gather the buffer and bucketer statistics of every rank (collective), write them on rank 0."""
        assert self._replay is not None
        buffer = self._replay.buffer
        bucketer = buffer.bucketer
        ids = bucketer.known_questions()
        local = {
            "question_ids": ids.numpy(),
            "rates": bucketer.rates(ids).numpy(),
            "by_domain": {name: r.numpy() for name, r in bucketer.rates_by_domain().items()},
            "retired": sorted(bucketer.retired),
            "entropy": buffer.entropies().numpy(),
            "trajectory_rates": buffer.rates().numpy(),
            "staleness": buffer.staleness(trainer.global_step).numpy(),
            "capacity": buffer.max_size,
        }
        if self._replayed:
            questions, entropies = (torch.cat(column) for column in zip(*self._replayed))
            local["replayed_rates"] = bucketer.rates(questions).numpy()
            local["replayed_entropy"] = entropies.float().numpy()
        self._replayed = []
        parts = _gather(local)
        if not trainer.is_global_zero:
            return
        rates = _pooled_question_rates(parts)
        entropy = np.concatenate([p["entropy"] for p in parts]).astype(np.float64)
        staleness = np.concatenate([p["staleness"] for p in parts]).astype(np.float64)

        tiers = tier_of(torch.from_numpy(rates), self.num_tiers)
        tier_counts = torch.bincount(tiers, minlength=self.num_tiers).tolist()
        scalars = {f"monitor/questions_by_tier_{i}": float(c) for i, c in enumerate(tier_counts)}
        if entropy.size:  # the band edges: the band counts are the percentiles' shares by construction
            percentiles = buffer.entropy_percentiles
            for percentile, edge in zip(percentiles, np.percentile(entropy, percentiles)):
                scalars[f"monitor/entropy_p{percentile:g}"] = float(edge)
        scalars["monitor/retired"] = float(len({q for p in parts for q in p["retired"]}))
        scalars["monitor/buffer_size"] = float(entropy.size)
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=step)

        writers = _tensorboard_writers(trainer)
        if writers and self._can_draw:
            self._log_heatmap(writers, parts, step)
        by_domain: dict[str, list[np.ndarray]] = {}
        for p in parts:
            for name, values in p["by_domain"].items():
                by_domain.setdefault(name, []).append(values)
        for writer in writers:
            _histogram(writer, "monitor/correctness_rate", rates, step)
            _histogram(writer, "monitor/entropy", entropy, step)
            _histogram(writer, "monitor/staleness", staleness, step)
            if len(by_domain) > 1:
                for name, values in sorted(by_domain.items()):
                    _histogram(writer, f"monitor/correctness_rate/{name}", np.concatenate(values), step)

    def _log_heatmap(self, writers: list[Any], parts: list[dict], step: int) -> None:
        """Draw `HEATMAP_TAG` from the pooled buffer (trajectories of questions the bucketer still knows) and
        the replayed rows since the last picture, on the run's bins and colour scale."""
        rates, entropy = _known(parts, "trajectory_rates", "entropy")
        replayed_rates, replayed_entropy = _known(parts, "replayed_rates", "replayed_entropy")
        if not rates.size:
            return
        if self._entropy_top is None:
            self._entropy_top = nice_ceiling(1.25 * max(float(entropy.max()), 1e-3))
        edges = np.linspace(0.0, self._entropy_top, ENTROPY_BINS + 1)
        stored = heatmap_counts(rates, entropy, self.num_tiers, edges)
        replayed = heatmap_counts(replayed_rates, replayed_entropy, self.num_tiers, edges)
        title = f"replay buffer at step {step}"
        image = draw_heatmap(stored, replayed, edges, title, sum(p["capacity"] for p in parts))
        description = (
            f"Left: replay buffer trajectories per cell; right: replayed rows trained on since the last "
            f"picture. x: question correctness rate in {self.num_tiers} equal-width tiers (hardest left); y: "
            f"trajectory mean token entropy in {ENTROPY_BINS} equal bins from 0 to {self._entropy_top:g} "
            "(higher in the top row); colour (log, the same at every step) and number: trajectories per cell."
        )
        for writer in writers:
            _add_image(writer, HEATMAP_TAG, image, step, description)

    # ----------------------------------------------------------------------------------- completions
    def _log_completions(self, trainer: Trainer, rollouts: RolloutBatch, step: int) -> None:
        writers = _tensorboard_writers(trainer)
        if not writers or len(rollouts) == 0:
            return
        n, replayed_rows = len(rollouts), np.flatnonzero(rollouts.replayed.cpu().numpy())
        # Replayed rows are a few of a mixed step's: up to half the table, so that one is ever seen.
        shown = self._rng.permutation(replayed_rows)[: self.completion_samples // 2]
        fresh = np.setdiff1d(np.arange(n), shown)
        more = self._rng.choice(
            fresh, size=min(self.completion_samples - len(shown), len(fresh)), replace=False
        )
        rows = np.sort(np.concatenate([shown, more]).astype(np.int64))
        rewards = rollouts.rewards.detach().float().cpu().tolist()
        replayed = rollouts.replayed.detach().cpu().tolist()
        # What the reward functions logged with `log_extra`, as TRL adds it to its completions table.
        extra = rollouts.extra or {}
        names = "".join(f" {_cell(name)} |" for name in extra)
        lines = [
            f"| prompt | completion | reward | replayed |{names}",
            "|---|---|---|---|" + "---|" * len(extra),
        ]
        for r in rows.tolist():
            prompt = rollouts.prompts[r] if rollouts.prompts else ""
            completion = rollouts.completions[r] if rollouts.completions else ""
            cells = "".join(f" {_cell(values[r])} |" for values in extra.values())
            lines.append(
                f"| {_cell(prompt)} | {_cell(completion)} | {rewards[r]:.3f} | {bool(replayed[r])} |{cells}"
            )
        table = "\n".join(lines)
        for writer in writers:
            writer.add_text("monitor/completions", table, step)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message)


def _add_image(writer: Any, tag: str, image: np.ndarray, step: int, description: str) -> None:
    """`writer.add_image`, with `description` in the image's metadata when the writer is torch's.

    TensorBoard keeps a tag's first metadata, so the description must hold for every step. Another writer
    (tensorboardX) takes its own protos, and gets the image alone.
    """
    if not isinstance(writer, SummaryWriter):
        writer.add_image(tag, image, step, dataformats="HWC")
        return
    summary = image_summary(tag, image, dataformats="HWC")
    summary.value[0].metadata.summary_description = description
    writer._get_file_writer().add_summary(summary, step)  # what add_image does, plus the description


def _known(parts: list[dict], rates_key: str, entropy_key: str) -> tuple[np.ndarray, np.ndarray]:
    """The pooled rates and entropies of `parts` whose question the bucketer knows (a rate, not NaN)."""
    rates = np.concatenate([p.get(rates_key, np.zeros(0)) for p in parts]).astype(np.float64)
    entropy = np.concatenate([p.get(entropy_key, np.zeros(0)) for p in parts]).astype(np.float64)
    known = ~np.isnan(rates)
    return rates[known], entropy[known]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _tensorboard_writers(trainer: Trainer) -> list[Any]:
    """The SummaryWriters of the trainer's TensorBoard loggers; touch only on global rank 0."""
    loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    if not trainer.is_global_zero:
        return [None] * len(loggers)  # same truthiness on every rank, no experiment created off rank 0
    return [lg.experiment for lg in loggers]


def _gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order. A collective under torch.distributed: all ranks must call it."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, obj)
        return parts
    return [obj]


def _pooled_question_rates(parts: list[dict]) -> np.ndarray:
    """One rate per known question over all ranks; a question known to several ranks gets their mean."""
    ids = np.concatenate([p["question_ids"] for p in parts]).astype(np.int64)
    rates = np.concatenate([p["rates"] for p in parts]).astype(np.float64)
    keep = ~np.isnan(rates)
    ids, rates = ids[keep], rates[keep]
    if len(parts) == 1:
        return rates
    unique, inverse = np.unique(ids, return_inverse=True)
    return np.bincount(inverse, weights=rates, minlength=len(unique)) / np.bincount(inverse)


def _histogram(writer: Any, tag: str, values: np.ndarray, step: int) -> None:
    if values.size:  # TensorBoard rejects empty histograms
        writer.add_histogram(tag, values, step)


def _cell(text: str) -> str:
    """`text` fit for one Markdown table cell: pipes escaped, newlines shown as ↵, long text cut."""
    text = str(text)
    if len(text) > _MAX_CELL_CHARS:
        text = text[:_MAX_CELL_CHARS] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", " ↵ ")

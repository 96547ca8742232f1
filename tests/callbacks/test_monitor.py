"""DifficultyMonitor in real Trainer runs on a tiny model: TensorBoard output, CSV fallback, DDP."""

import csv
import io
import json
import sys

import numpy as np
import pytest
from conftest import tiny_module
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl.callbacks import DifficultyMonitor, ReplayCallback
from exgrpo_pl.callbacks.heatmap import draw_heatmap, heatmap_counts, nice_ceiling
from exgrpo_pl.callbacks.monitor import ENTROPY_BINS
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay

HISTOGRAMS = {"monitor/correctness_rate", "monitor/entropy", "monitor/staleness"}
NO_TENSORBOARD = "histograms, images and text need a TensorBoardLogger"


def callbacks(with_replay=True):
    monitor = DifficultyMonitor(log_every_n_steps=1, completion_table_every_n_steps=1)
    if not with_replay:
        return [monitor]
    replay = SelectiveReplay(strategy="uniform", replay_probability=1.0)
    return [ReplayCallback(replay=replay, min_buffer_size=1), monitor]


def fit(tmp_path, model_dir, logger, extra=(), with_replay=True, module_options=None, **trainer_kwargs):
    seed_everything(0)
    trainer = Trainer(
        max_epochs=2,
        limit_train_batches=2,
        accelerator="cpu",
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[*callbacks(with_replay), *extra],
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(tiny_module(model_dir, **(module_options or {})), data)
    return trainer


def read_events(path):
    sizes = {"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}
    events = EventAccumulator(str(path), size_guidance=sizes)
    events.Reload()
    return events


def test_with_two_updates_a_batch_the_monitor_logs_on_the_batch_axis(tmp_path, tiny_model_dir):
    options = {"num_iterations": 2}  # two optimizer updates a batch, as with steps_per_generation=2
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = fit(tmp_path, tiny_model_dir, logger, module_options=options, log_every_n_steps=1)
    events = read_events(trainer.logger.log_dir)
    assert trainer.global_step == 8  # 4 batches, 2 optimizer updates each
    assert [i.step for i in events.Images("monitor/difficulty_entropy_heatmap")] == [1, 2, 3, 4]
    assert events.Scalars("monitor/buffer_size")[-1].step == 4
    # the module's metrics of the n-th batch sit at step n - 1 (Lightning's count of batches before it)
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2, 3]  # a swap step logs no reward


def test_tensorboard_gets_histograms_heatmap_completions_and_tier_counts(tmp_path, tiny_model_dir):
    trainer = fit(tmp_path, tiny_model_dir, TensorBoardLogger(tmp_path, name="tb"))
    events = read_events(trainer.logger.log_dir)
    tags = events.Tags()
    assert HISTOGRAMS <= set(tags["histograms"])
    # ArithmeticTask's question families are domains, so each gets its own correctness histogram.
    assert any(t.startswith("monitor/correctness_rate/") for t in tags["histograms"])
    assert "monitor/difficulty_entropy_heatmap" in tags["images"]
    # Every log_every_n_steps (1) once the buffer holds something, not only at the two epochs' ends.
    assert [i.step for i in events.Images("monitor/difficulty_entropy_heatmap")] == [1, 2, 3, 4]
    assert any(t.startswith("monitor/completions") for t in tags["tensors"])  # add_text stores a tensor
    scalars = set(tags["scalars"])
    assert {f"monitor/questions_by_tier_{i}" for i in range(5)} <= scalars
    assert {"monitor/entropy_p25", "monitor/entropy_p50", "monitor/entropy_p75"} <= scalars
    assert {"monitor/retired", "monitor/buffer_size"} <= scalars
    # No series that says nothing: band counts are the percentiles' shares, the replayed share is replay's.
    assert not {t for t in scalars if t.startswith("monitor/entropy_band") or t == "monitor/replay_fraction"}

    replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
    last = lambda tag: events.Scalars(tag)[-1]  # noqa: E731
    assert last("monitor/buffer_size").value == len(replay.buffer) > 0
    assert last("monitor/buffer_size").step == trainer.global_step == 4
    tiers = sum(last(f"monitor/questions_by_tier_{i}").value for i in range(5))
    assert tiers == len(replay.buffer.bucketer.known_questions())
    edges = np.percentile(replay.buffer.entropies().numpy().astype(np.float64), [25, 50, 75])
    assert [last(f"monitor/entropy_p{p}").value for p in (25, 50, 75)] == pytest.approx(edges.tolist())
    (text,) = {t for t in tags["tensors"] if t.startswith("monitor/completions")}
    table = events.Tensors(text)[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| prompt | completion | reward | replayed |")
    assert 1 <= len(table.splitlines()) - 2 <= 8  # up to completion_samples rows of the latest step


def judged(prompts, completions, log_extra, **columns):
    """A reward that logs a column for TRL's completions table: each completion's length, in words."""
    log_extra("judge_says", [f"{len(completion)} chars" for completion in completions])
    return [float(len(completion) % 2) for completion in completions]


def test_the_completions_table_shows_what_the_rewards_logged_with_log_extra(tmp_path, tiny_model_dir):
    seed_everything(0)
    trainer = Trainer(
        max_steps=2, accelerator="cpu", logger=TensorBoardLogger(tmp_path, name="tb"),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        limit_val_batches=0, callbacks=callbacks(with_replay=False), default_root_dir=tmp_path,
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(tiny_module(tiny_model_dir, reward_funcs=[judged]), data)
    events = read_events(trainer.logger.log_dir)
    (text,) = {t for t in events.Tags()["tensors"] if t.startswith("monitor/completions")}
    header, _, *rows = events.Tensors(text)[-1].tensor_proto.string_val[0].decode().splitlines()
    assert header == "| prompt | completion | reward | replayed | judge_says |"
    assert rows
    for row in rows:  # each row's value is the one logged for its own completion
        _, completion, _, _, said = row.strip("| ").split(" | ")
        assert said == f"{len(completion)} chars"


def test_csv_logger_gets_the_scalars_and_one_warning(tmp_path, tiny_model_dir, recwarn):
    trainer = fit(tmp_path, tiny_model_dir, CSVLogger(tmp_path, name="csv"))
    assert sum(NO_TENSORBOARD in str(w.message) for w in recwarn) == 1
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("monitor/buffer_size")]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert {f"monitor/questions_by_tier_{i}" for i in range(5)} <= set(rows[-1])
    replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
    assert float(rows[-1]["monitor/buffer_size"]) == len(replay.buffer)


def test_without_replay_callback_it_warns_once_and_logs_only_completions(tmp_path, tiny_model_dir, recwarn):
    logger = TensorBoardLogger(tmp_path, name="tb")
    fit(tmp_path, tiny_model_dir, logger, with_replay=False)
    assert sum("no ReplayCallback" in str(w.message) for w in recwarn) == 1
    tags = read_events(logger.log_dir).Tags()
    assert not tags["histograms"] and not tags["images"]
    assert any(t.startswith("monitor/completions") for t in tags["tensors"])
    assert not any(t.startswith("monitor/") for t in tags["scalars"])


class RecordBufferSize(Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
        record = {"buffer": len(replay.buffer), "log_dir": trainer.logger.log_dir}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.multiprocess
def test_ddp_pools_all_ranks_and_only_rank_zero_writes(tmp_path, tiny_model_dir):
    fit(
        tmp_path,
        tiny_model_dir,
        TensorBoardLogger(tmp_path, name="tb"),
        extra=[RecordBufferSize(tmp_path)],
        module_options={"num_generations": 2},
        strategy="ddp_fork",
        devices=2,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    event_files = sorted(tmp_path.rglob("events.out.tfevents.*"))
    with_histograms = [f for f in event_files if HISTOGRAMS <= set(read_events(f).Tags()["histograms"])]
    assert len(with_histograms) == 1
    events = read_events(with_histograms[0])
    assert events.Scalars("monitor/buffer_size")[-1].value == sum(r["buffer"] for r in ranks)
    assert ranks[0]["buffer"] > 0 and ranks[1]["buffer"] > 0
    assert "monitor/difficulty_entropy_heatmap" in events.Tags()["images"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
        ({"num_tiers": 0}, "num_tiers=0"),
        ({"completion_table_every_n_steps": -1}, "completion_table_every_n_steps=-1"),
        ({"completion_samples": 0}, "completion_samples=0"),
    ],
)
def test_bad_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DifficultyMonitor(**kwargs)


def test_heatmap_counts_small_exact_case():
    rates = np.array([0.0, 0.1, 0.5, 1.0, 1.0])  # tiers of 2: [0, 0.5) and [0.5, 1]
    entropy = np.array([0.0, 1.0, 2.0, 2.0, 0.5])  # bins [0, 1) and [1, 2], 2 in the top one
    counts = heatmap_counts(rates, entropy, num_tiers=2, edges=np.array([0.0, 1.0, 2.0]))
    assert counts.tolist() == [[1, 1], [1, 2]]  # row 0: the low entropies
    # Fixed edges: an entropy past the top edge (or below the first) is counted in the end row.
    assert heatmap_counts(
        np.array([0.2, 0.7]), np.array([9.0, -1.0]), 2, np.array([0.0, 1.0, 2.0])
    ).tolist() == [
        [0, 1],
        [1, 0],
    ]


@pytest.mark.parametrize("value, ceiling", [(0.3, 0.5), (1.0, 1.0), (1.01, 2.0), (2.2, 2.5), (37.0, 50.0)])
def test_the_heatmaps_top_edge_is_a_round_number_above(value, ceiling):
    assert nice_ceiling(value) == pytest.approx(ceiling)


@given(
    st.lists(st.tuples(st.floats(0, 1), st.floats(-5, 5, allow_subnormal=False)), min_size=1, max_size=40),
    st.integers(1, 6),
    st.integers(1, 12),
)
def test_heatmap_counts_hold_every_trajectory_once(rows, num_tiers, bins):
    rates, entropy = (np.array(column, dtype=np.float64) for column in zip(*rows))
    counts = heatmap_counts(rates, entropy, num_tiers, np.linspace(0.0, 2.0, bins + 1))
    assert counts.shape == (bins, num_tiers) and counts.sum() == len(rows)


class LastRollouts(Callback):
    """Keeps the last step's rollouts."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollouts = outputs["rollouts"]


def test_the_heatmap_image_is_the_buffer_and_what_replay_drew_on_one_scale(tmp_path, tiny_model_dir):
    last_rollouts = LastRollouts()
    trainer = fit(tmp_path, tiny_model_dir, TensorBoardLogger(tmp_path, name="tb"), extra=[last_rollouts])
    events = read_events(trainer.logger.log_dir)
    pictures = events.Images("monitor/difficulty_entropy_heatmap")
    replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
    monitor = next(c for c in trainer.callbacks if isinstance(c, DifficultyMonitor))
    rates = replay.buffer.rates().numpy().astype(np.float64)
    entropy = replay.buffer.entropies().numpy().astype(np.float64)
    known = ~np.isnan(rates)
    edges = np.linspace(0.0, monitor._entropy_top, ENTROPY_BINS + 1)  # set by the first picture, kept
    stored = heatmap_counts(rates[known], entropy[known], 5, edges)
    # The right panel: the rows replayed since the previous picture (one step: a picture every step).
    rollouts = last_rollouts.rollouts
    rows = rollouts.replayed
    replayed = heatmap_counts(
        replay.buffer.bucketer.rates(rollouts.question_ids[rows]).numpy(),
        rollouts.entropy[rows].numpy(),
        5,
        edges,
    )
    assert replayed.sum() > 0  # the last step replayed (swap mode, probability 1)
    expected = draw_heatmap(stored, replayed, edges, "replay buffer at step 4", replay.buffer.max_size)
    shown = np.asarray(Image.open(io.BytesIO(pictures[-1].encoded_image_string)).convert("RGB"))
    assert pictures[-1].step == trainer.global_step and np.array_equal(shown, expected)
    assert shown.shape == (440, 800, 3)  # room for two panels' axes, tick labels and one colour bar
    description = events.SummaryMetadata("monitor/difficulty_entropy_heatmap").summary_description
    assert "x: question correctness rate in 5 equal-width tiers" in description
    assert "right: replayed rows" in description and "the same at every step" in description


def test_the_completion_table_shows_a_replayed_row_of_a_mixed_step(tmp_path, tiny_model_dir):
    # A mixed step of 4 questions x 4 rollouts holds one stored row in 16: a random pair would rarely show it.
    replay = ReplayCallback(
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0), mode="mix", mix_fraction=0.25,
        min_buffer_size=1,
    )  # fmt: skip
    monitor = DifficultyMonitor(log_every_n_steps=4, completion_table_every_n_steps=1, completion_samples=2)
    trainer = fit(
        tmp_path, tiny_model_dir, TensorBoardLogger(tmp_path, name="tb"), extra=[replay, monitor],
        with_replay=False, module_options={"num_generations": 4},
    )  # fmt: skip
    events = read_events(trainer.logger.log_dir)
    (tag,) = {t for t in events.Tags()["tensors"] if t.startswith("monitor/completions")}
    tables = [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
    # Ours are the 2-row tables (the other monitor, of `fit`'s callbacks, writes 8 rows).
    pairs = [[row.strip("| ").split(" | ")[3] for row in table.splitlines()[2:]] for table in tables]
    pairs = [column for column in pairs if len(column) == 2]
    assert replay.replayed_steps > 0 and len(pairs) == 4
    assert sum("True" in column for column in pairs) == replay.replayed_steps


def test_without_matplotlib_it_warns_once_and_logs_the_rest(tmp_path, tiny_model_dir, monkeypatch, recwarn):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    trainer = fit(tmp_path, tiny_model_dir, TensorBoardLogger(tmp_path, name="tb"))
    assert sum("pip install 'exgrpo-pl[viz]'" in str(w.message) for w in recwarn) == 1
    tags = read_events(trainer.logger.log_dir).Tags()
    assert not tags["images"] and HISTOGRAMS <= set(tags["histograms"])


def test_an_image_with_a_description_reaches_the_event_file(tmp_path):
    """`_add_image` writes through torch's private `SummaryWriter._get_file_writer()`, keeping the text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from exgrpo_pl.callbacks.monitor import _add_image

    writer = SummaryWriter(tmp_path)
    _add_image(writer, "buckets", np.zeros((2, 3, 3), dtype=np.uint8), 7, "questions per bucket")
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    (image,) = events.Images("buckets")
    assert image.step == 7 and (image.width, image.height) == (3, 2)
    assert events.SummaryMetadata("buckets").summary_description == "questions per bucket"

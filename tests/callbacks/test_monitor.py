"""DifficultyMonitor in real Trainer runs on a tiny model: TensorBoard output, CSV fallback, DDP."""

import csv
import io
import json
import sys

import numpy as np
import pytest
from conftest import tiny_module
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from exgrpo_pl.callbacks import DifficultyMonitor, ReplayCallback
from exgrpo_pl.callbacks.monitor import heatmap_image
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


def fit(tmp_path, model_dir, logger, extra=(), num_generations=4, with_replay=True, **trainer_kwargs):
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
    trainer.fit(tiny_module(model_dir, num_generations=num_generations), data)
    return trainer


def read_events(path):
    sizes = {"scalars": 0, "histograms": 0, "images": 0, "tensors": 0}
    events = EventAccumulator(str(path), size_guidance=sizes)
    events.Reload()
    return events


def test_tensorboard_gets_histograms_heatmap_completions_and_tier_counts(tmp_path, tiny_model_dir):
    trainer = fit(tmp_path, tiny_model_dir, TensorBoardLogger(tmp_path, name="tb"))
    events = read_events(trainer.logger.log_dir)
    tags = events.Tags()
    assert HISTOGRAMS <= set(tags["histograms"])
    # ArithmeticTask's question families are domains, so each gets its own correctness histogram.
    assert any(t.startswith("monitor/correctness_rate/") for t in tags["histograms"])
    assert "monitor/difficulty_entropy_heatmap" in tags["images"]
    assert len(events.Images("monitor/difficulty_entropy_heatmap")) == 2  # one per epoch
    assert any(t.startswith("monitor/completions") for t in tags["tensors"])  # add_text stores a tensor
    scalars = set(tags["scalars"])
    assert {f"monitor/tier_{i}" for i in range(5)} <= scalars
    assert {f"monitor/entropy_band_{i}" for i in range(4)} <= scalars  # percentiles (25, 50, 75): 4 bands
    assert {"monitor/retired", "monitor/buffer_size", "monitor/replay_fraction"} <= scalars

    replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
    last = lambda tag: events.Scalars(tag)[-1]  # noqa: E731
    assert last("monitor/buffer_size").value == len(replay.buffer) > 0
    assert last("monitor/buffer_size").step == trainer.global_step == 4
    tiers = sum(last(f"monitor/tier_{i}").value for i in range(5))
    assert tiers == len(replay.buffer.bucketer.known_questions())
    assert sum(last(f"monitor/entropy_band_{i}").value for i in range(4)) == len(replay.buffer)
    assert last("monitor/replay_fraction").value == 1.0  # swap mode, replay_probability 1
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
    assert {f"monitor/tier_{i}" for i in range(5)} <= set(rows[-1])
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
        num_generations=2,
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


def test_heatmap_image_exact_colours_and_layout():
    counts = np.array([[0, 2], [1, 0]])  # [entropy bin, tier]: bin 0 drawn at the bottom
    image = heatmap_image(counts)
    cell_h, cell_w = 24, 40
    assert image.dtype == np.uint8 and image.shape == (2 * cell_h, 2 * cell_w + 8 + 12, 3)
    pixel = lambda row, column: image[row * cell_h + 5, column * cell_w + 5].tolist()  # noqa: E731
    assert pixel(1, 0) == [68, 1, 84]  # bottom left: bin 0, tier 0, count 0: darkest
    assert pixel(1, 1) == [253, 231, 37]  # bottom right: count 2, the largest: brightest
    assert pixel(0, 0) == [33, 145, 140]  # top left: count 1 of 2, the middle of the colour map
    assert image[:, cell_w].tolist() == [[255, 255, 255]] * (2 * cell_h)  # the line between the two tiers
    bar = image[:, -1]
    assert bar[0].tolist() == [253, 231, 37] and bar[-1].tolist() == [68, 1, 84]  # largest on top
    assert heatmap_image(np.zeros((3, 4), dtype=np.int64)).shape == (3 * cell_h, 4 * cell_w + 20, 3)


def test_heatmap_is_drawn_without_matplotlib_with_its_axes_described(
    tmp_path, tiny_model_dir, monkeypatch, recwarn
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` raises ImportError
    trainer = fit(tmp_path, tiny_model_dir, TensorBoardLogger(tmp_path, name="tb"))
    assert not any("matplotlib" in str(w.message) for w in recwarn)
    events = read_events(trainer.logger.log_dir)
    (first, last) = events.Images("monitor/difficulty_entropy_heatmap")
    # The last image is the final buffer's, pixel for pixel.
    replay = next(c for c in trainer.callbacks if isinstance(c, ReplayCallback))
    monitor = next(c for c in trainer.callbacks if isinstance(c, DifficultyMonitor))
    buffer = replay.buffer
    rates, entropy = buffer.rates().numpy().astype(np.float64), buffer.entropies().numpy().astype(np.float64)
    known = ~np.isnan(rates)
    expected, scale = monitor._heatmap(rates[known], entropy[known])
    shown = np.asarray(Image.open(io.BytesIO(last.encoded_image_string)).convert("RGB"))
    assert last.step == trainer.global_step and np.array_equal(shown, expected)
    description = events.SummaryMetadata("monitor/difficulty_entropy_heatmap").summary_description
    assert "x: question correctness rate in 5 equal-width tiers" in description
    assert (
        "y: trajectory mean token entropy" in description and "Colour: trajectories per cell" in description
    )
    texts = events.Tensors("monitor/difficulty_entropy_heatmap/text_summary")
    assert [t.step for t in texts] == [first.step, last.step]
    assert texts[-1].tensor_proto.string_val[0].decode() == scale
    assert scale.startswith(f"{int(known.sum())} trajectories; entropy ")


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

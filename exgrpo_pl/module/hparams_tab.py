"""The run's row in TensorBoard's HParams tab: the settings that tell runs apart, and the metrics to sort by.

Lightning writes an HParams entry only with a metric, and its default TensorBoardLogger's metric is a
placeholder (`hp_metric`, -1 at step 0; the `exgrpo` CLI turns it off). `log_run_hparams` writes the entry
itself: the module's options, the options of each callback that exposes them as a mapping `hparams`
(`ReplayCallback`: mode, mix_fraction, the buffer's, bucketer's and sampler's), less internals (names that
start with `_`, such as LightningCLI's `_instantiator`); a run without replay writes `OFF_WITHOUT_REPLAY`
(`ReplayCallback.mode` "off", `.mix_fraction` 0, `.placement` "off"), so the table and parallel coordinates
draw every run on those axes.

How TensorBoard (2.21) builds the tab, which the layout written here follows: its columns come from one
experiment summary (the first run it reads that has one, in no set order), or, with none, from every run's
options and every scalar tag; the options marked `differs` come first, then by name, and the table shows
the first five options and the first five metrics. So no run writes an experiment summary of its own: the
log folder has one (`FOLDER_SUMMARY`, in the folder itself, TensorBoard's run `.`), rewritten by each run
that starts there, with every option of the folder's runs, marked `differs` where two runs hold different
values, and the metrics of `HPARAMS_METRICS`, whose last value in each run TensorBoard shows beside them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.tensorflow_stub.errors import DataLossError
from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
from tensorboard.summary.writer.record_writer import RecordWriter
from torch.utils.tensorboard.summary import hparams

HPARAMS_METRICS = (
    "val/pass@1",  # the final validation pass@1
    "val/best_pass@1",  # the best validation pass@1 of the run, the one before training included
    "replay/replayed_steps",  # steps that trained on replayed trajectories (none: not a replay run)
)
# What a run without a ReplayCallback writes for the replay options that say whether and how it replays.
OFF_WITHOUT_REPLAY = {
    "ReplayCallback.mode": "off",
    "ReplayCallback.mix_fraction": 0.0,
    "ReplayCallback.placement": "off",
}
# The log folder's experiment summary; "tfevents" in the name is what makes TensorBoard read the file.
FOLDER_SUMMARY = "events.out.tfevents.hparams-columns"
_RECORDS_READ = 1000  # records of another run's event file read for its options (written before step 1)


def run_hparams(module_hparams: Mapping[str, Any], callbacks: Iterable[Any]) -> dict[str, Any]:
    """The module's options and the callbacks' (`<ClassName>.<option>`), as bool, int, float or str, less
    internals (names starting with `_`); `OFF_WITHOUT_REPLAY` for a run whose callbacks have no
    `ReplayCallback.mode`.

    Args:
        module_hparams: the LightningModule's `hparams`.
        callbacks: the trainer's callbacks; those with a mapping `hparams` contribute its items.
    """
    params = {name: _plain(value) for name, value in module_hparams.items()}
    for callback in callbacks:
        options = getattr(callback, "hparams", None)
        if isinstance(options, Mapping):
            prefix = type(callback).__name__
            params.update({f"{prefix}.{name}": _plain(value) for name, value in options.items()})
    if "ReplayCallback.mode" not in params:
        params.update(OFF_WITHOUT_REPLAY)
    return {name: value for name, value in params.items() if not name.split(".")[-1].startswith("_")}


def log_run_hparams(trainer: Trainer, params: Mapping[str, Any]) -> None:
    """Writes `params` as the run's HParams entry to each TensorBoard logger, and the log folder's
    experiment summary (`write_folder_summary`).

    No metric values are written here (Lightning's `log_hyperparams` would log them at step 0, a point on
    the real charts): TensorBoard reads each metric's values from the run's own scalars of that tag.
    """
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            writer = logger.experiment._get_file_writer()  # what Lightning's log_hyperparams writes to
            experiment, start, end = hparams(dict(params), dict.fromkeys(HPARAMS_METRICS, 0.0))
            for summary in (start, end):
                writer.add_summary(summary)
            writer.flush()  # the next run's summary reads this run's options from the file
            root, run = Path(logger.root_dir), Path(logger.log_dir)
            if root.resolve() == run.resolve():  # the run is the folder: its summary is its own
                writer.add_summary(with_differs(experiment, [session_hparams(start)]))
            else:
                write_folder_summary(root, run, experiment, start)


def write_folder_summary(root: Path, run: Path, experiment: Any, start: Any) -> None:
    """Replaces `root`'s `FOLDER_SUMMARY` by one with the options of every run under `root` (this one's
    from `start`, the others' read from their event files) marked `differs` where values differ.

    Args:
        root: the log folder (`tensorboard --logdir`).
        run: this run's folder in it.
        experiment: the experiment summary `torch.utils.tensorboard.summary.hparams` built for this run.
        start: its session-start summary.
    """
    runs = [session_hparams(start)]
    for folder, _, files in os.walk(root):
        if Path(folder).resolve() != run.resolve() and Path(folder).resolve() != root.resolve():
            found = _hparams_in(Path(folder), files)
            if found is not None:
                runs.append(found)
    event = Event(wall_time=time.time(), step=0, summary=with_differs(experiment, runs))
    temporary = root / f".{FOLDER_SUMMARY.replace('tfevents', 'partial')}.{os.getpid()}"
    with open(temporary, "wb") as file:
        RecordWriter(file).write(event.SerializeToString())
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, root / FOLDER_SUMMARY)  # whole or not at all: TensorBoard never reads half


def with_differs(experiment: Any, runs: list[Mapping[str, Any]]) -> Any:
    """The experiment `summary` with an option for each name of `runs` (each a run's options, as protobuf
    `Value`s), typed by its values and marked `differs` when two runs that have it hold different ones."""
    plugin_data = experiment.value[0].metadata.plugin_data
    content = plugin_data_pb2.HParamsPluginData.FromString(plugin_data.content)
    infos = content.experiment.hparam_infos
    del infos[:]
    for name in sorted({name for options in runs for name in options}):
        values = [options[name] for options in runs if name in options]
        kinds = {value.WhichOneof("kind") for value in values}
        distinct = {
            (value.WhichOneof("kind"), str(getattr(value, value.WhichOneof("kind")))) for value in values
        }
        kind = kinds.pop() if len(kinds) == 1 else "string_value"  # mixed kinds: shown as text
        info = infos.add(name=name, differs=len(distinct) > 1, type=_TYPES[kind])
        if info.type == api_pb2.DATA_TYPE_FLOAT64:
            numbers = [value.number_value for value in values]
            info.domain_interval.min_value, info.domain_interval.max_value = min(numbers), max(numbers)
        else:
            info.domain_discrete.extend(sorted({text for _, text in distinct}))
    plugin_data.content = content.SerializeToString()
    return experiment


_TYPES = {
    "number_value": api_pb2.DATA_TYPE_FLOAT64,
    "bool_value": api_pb2.DATA_TYPE_BOOL,
    "string_value": api_pb2.DATA_TYPE_STRING,
}


def session_hparams(start: Any) -> Mapping[str, Any]:
    """The options (name to protobuf `Value`) of a session-start summary."""
    content = plugin_data_pb2.HParamsPluginData.FromString(start.value[0].metadata.plugin_data.content)
    return content.session_start_info.hparams


def _hparams_in(folder: Path, files: list[str]) -> Mapping[str, Any] | None:
    """The options a run's event files in `folder` hold (the first session start found), or None."""
    for name in sorted(files):
        if "tfevents" not in name or name == FOLDER_SUMMARY:
            continue
        try:
            for number, event in enumerate(EventFileLoader(str(folder / name)).Load()):
                if number >= _RECORDS_READ:
                    break
                for value in event.summary.value:
                    if value.tag == metadata.SESSION_START_INFO_TAG:
                        content = value.metadata.plugin_data.content
                        return metadata.parse_session_start_info_plugin_data(content).hparams
        except (OSError, DataLossError):  # another run's unreadable file: its options are not compared
            continue
    return None


def _plain(value: Any) -> bool | int | float | str:
    """A value the HParams tab can show and sort: numbers and text as they are, anything else as text."""
    return value if isinstance(value, bool | int | float | str) else str(value)

"""The run's row in TensorBoard's HParams tab: the settings that tell runs apart, and the metrics to sort by.

Lightning writes an HParams entry only with a metric, and its default TensorBoardLogger's metric is a
placeholder (`hp_metric`, -1 at step 0; the `exgrpo` CLI turns it off). `log_run_hparams` writes the entry
itself: the module's options, the options of each callback that exposes them as a mapping `hparams`
(`ReplayCallback`: mode, mix_fraction, the buffer's, bucketer's and sampler's), and the tags of
`HPARAMS_METRICS`, whose last value in the run TensorBoard shows beside them.

How TensorBoard (2.21) builds the tab, which the layout written here follows: its table's columns come from
the experiment summary of one run (the first it reads that has one), sorted with the options marked
`differs` first, then by name; the table shows the first five options and the first five metrics, the
others are listed to tick. So every run writes the options of `COMPARED_HPARAMS`, marked `differs`, into its
experiment summary, whether it has them or not (a GRPO run has no `ReplayCallback`: its cells stay empty),
and whichever run TensorBoard reads first, the table opens on the options that tell a GRPO run from an
ExGRPO one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2
from torch.utils.tensorboard.summary import hparams

HPARAMS_METRICS = (
    "val/pass@1",  # the final validation pass@1
    "val/best_pass@1",  # the best validation pass@1 of the run, the one before training included
    "replay/replayed_steps",  # steps that trained on replayed trajectories (none: not a replay run)
)
# The options the HParams table shows by default (TensorBoard shows five), with their type for the runs that
# lack them: where replayed experience goes and how much of it, how it is chosen, and the update's step size
# and loss. The GRPO and ExGRPO presets differ in the first three.
COMPARED_HPARAMS = {
    "ReplayCallback.mode": api_pb2.DATA_TYPE_STRING,
    "ReplayCallback.mix_fraction": api_pb2.DATA_TYPE_FLOAT64,
    "ReplayCallback.replay.strategy": api_pb2.DATA_TYPE_STRING,
    "learning_rate": api_pb2.DATA_TYPE_FLOAT64,
    "loss_type": api_pb2.DATA_TYPE_STRING,
}


def run_hparams(module_hparams: Mapping[str, Any], callbacks: Iterable[Any]) -> dict[str, Any]:
    """The module's options and the callbacks' (`<ClassName>.<option>`), as bool, int, float or str.

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
    return params


def log_run_hparams(trainer: Trainer, params: Mapping[str, Any]) -> None:
    """Writes `params` with `HPARAMS_METRICS` as the run's HParams entry to each TensorBoard logger.

    No metric values are written here (Lightning's `log_hyperparams` would log them at step 0, a point on
    the real charts): TensorBoard reads each metric's values from the run's own scalars of that tag.
    """
    if not trainer.is_global_zero:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            writer = logger.experiment._get_file_writer()  # what Lightning's log_hyperparams writes to
            experiment, start, end = hparams(dict(params), dict.fromkeys(HPARAMS_METRICS, 0.0))
            for summary in (mark_compared(experiment), start, end):
                writer.add_summary(summary)


def mark_compared(summary: Any) -> Any:
    """The experiment `summary` that `hparams` wrote, with each option of `COMPARED_HPARAMS` in it (added
    where the run lacks it) and marked `differs`, which TensorBoard's table shows first."""
    plugin_data = summary.value[0].metadata.plugin_data
    content = plugin_data_pb2.HParamsPluginData.FromString(plugin_data.content)
    infos = content.experiment.hparam_infos
    known = {info.name: info for info in infos}
    for name, data_type in COMPARED_HPARAMS.items():
        info = known.get(name) or infos.add(name=name, type=data_type)
        info.differs = True
    plugin_data.content = content.SerializeToString()
    return summary


def _plain(value: Any) -> bool | int | float | str:
    """A value the HParams tab can show and sort: numbers and text as they are, anything else as text."""
    return value if isinstance(value, bool | int | float | str) else str(value)

"""The run's row in TensorBoard's HParams tab: the settings that tell runs apart, and the metrics to sort by.

Lightning writes an HParams entry only with a metric, and its default TensorBoardLogger's metric is a
placeholder (`hp_metric`, -1 at step 0; the `exgrpo` CLI turns it off). `log_run_hparams` writes the entry
itself: the module's options, the options of each callback that exposes them as a mapping `hparams`
(`ReplayCallback`: mode, mix_fraction, the buffer's, bucketer's and sampler's), and the tags of
`HPARAMS_METRICS`, whose last value in the run TensorBoard shows beside them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard.summary import hparams

HPARAMS_METRICS = (
    "val/pass@1",  # the final validation pass@1
    "val/best_pass@1",  # the best validation pass@1 of the run, the one before training included
    "replay/replayed_steps",  # steps that trained on replayed trajectories (none: not a replay run)
)


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
            for summary in hparams(dict(params), dict.fromkeys(HPARAMS_METRICS, 0.0)):
                writer.add_summary(summary)


def _plain(value: Any) -> bool | int | float | str:
    """A value the HParams tab can show and sort: numbers and text as they are, anything else as text."""
    return value if isinstance(value, bool | int | float | str) else str(value)

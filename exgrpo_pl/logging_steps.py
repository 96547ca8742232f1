"""When step metrics reach the loggers, so that the module and the callbacks build them only then.

Lightning writes `on_step` metrics every `trainer.log_every_n_steps` steps and flushes the last values when an
epoch or the run ends. A `self.log` call costs about a millisecond, and logging twenty on every step makes
the embedded model's step 4-12% longer (benchmarks/overhead.py); logging on the other steps changes nothing
a logger sees.
"""

from __future__ import annotations

from lightning.pytorch import Trainer


def writes_step_metrics(trainer: Trainer) -> bool:
    """Whether metrics logged in this training step reach the loggers.

    True on Lightning's logging steps (the check its own `LearningRateMonitor` makes, which includes a run
    stopped by `should_stop`), on an epoch's last batch and on the run's last step (`max_steps`). Ask as late
    in the step as possible: in the LightningModule's `on_train_batch_end`, which runs after every
    callback's, a callback that stops the run on this step has already said so.
    """
    loop = trainer.fit_loop.epoch_loop
    epoch_ends = (
        loop.batch_progress.is_last_batch or loop.batch_progress.current.ready >= trainer.num_training_batches
    )
    run_ends = trainer.max_steps > 0 and loop._batches_that_stepped + 1 >= trainer.max_steps
    return trainer._logger_connector.should_update_logs or epoch_ends or run_ends

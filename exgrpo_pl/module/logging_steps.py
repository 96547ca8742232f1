"""When step metrics reach the loggers, so that the module and the callbacks build them only then.

Lightning writes `on_step` metrics every `trainer.log_every_n_steps` steps and flushes the last values when an
epoch or the run ends. A `self.log` call costs about a millisecond, and logging twenty on every step makes
the embedded model's step 4-12% longer (benchmarks/overhead.py); logging on the other steps changes nothing
a logger sees.
"""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer
from torch import Tensor

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.engines.generation import completion_mask_from_ids
from exgrpo_pl.lightning_internals import batches_that_stepped, should_update_logs


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
    run_ends = trainer.max_steps > 0 and batches_that_stepped(trainer) + 1 >= trainer.max_steps
    return should_update_logs(trainer) or epoch_ends or run_ends


def step_metrics(
    rollouts: RolloutBatch, eos_token_ids: list[int], stats: dict, timings: dict[str, float]
) -> dict[str, Tensor]:
    """A training step's metrics under TRL's names (`train/*`), plus its `timing/*` seconds.

    The rewards (`train/reward`, `train/pass@1`, `train/reward_std`, `train/frac_reward_zero_std`) are those
    of the step's fresh rows, sampled from the current policy: replayed rows were stored because they were
    correct, and would lift the curve by what the buffer holds. A step without fresh rows (a swap replay
    step) has none of them; the spread is that of the groups whose rows are all fresh. `train/pass@1` (the
    share of correct rows) is left out when the step's rewards are its correctness (a 0/1 verifier): it
    would repeat `train/reward` point for point.

    Args:
        rollouts: what the step trained on.
        eos_token_ids: ids that end a completion (a completion without one was clipped by the budget).
        stats: `train/<key>` values: the update's statistics and the module's counters.
        timings: `timing/*` and `train/rewards/*` values, logged under their own names.
    """
    _, truncated = completion_mask_from_ids(rollouts.completion_ids, eos_token_ids)
    metrics = {
        **{key: torch.as_tensor(float(value)) for key, value in timings.items()},
        **{f"train/{key}": torch.as_tensor(value, dtype=torch.float32) for key, value in stats.items()},
        "train/completions/mean_length": rollouts.completion_lengths.float().mean(),
        "train/completions/clipped_ratio": truncated.float().mean(),
        "train/entropy": rollouts.entropy.mean(),
    }
    fresh = ~rollouts.replayed
    if not bool(fresh.any()):
        return metrics
    rewards, correct = rollouts.rewards[fresh].float(), rollouts.correct[fresh].float()
    metrics["train/reward"] = rewards.mean()
    if not torch.equal(rewards, correct):
        metrics["train/pass@1"] = correct.mean()
    if rollouts.group_size > 1:  # a swap batch has no groups
        whole = fresh.view(-1, rollouts.group_size).all(1)  # a mixed group holds one stored row
        if bool(whole.any()):
            group_std = rollouts.rewards.view(-1, rollouts.group_size)[whole].std(1)
            metrics["train/reward_std"] = group_std.mean()
            metrics["train/frac_reward_zero_std"] = (group_std == 0).float().mean()
    return metrics

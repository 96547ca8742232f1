"""What `ReplayCallback` logs each logging step (the `replay/*` charts), over all ranks.

Each rank replays and stores its own share of the batch, so a chart of one rank's numbers would show a part
of the run. The charts are one all-reduce over the ranks: what each rank holds or counts (the buffer, its
tiers, the retired questions, the joined or refilled groups, the deferred questions) is the total over ranks;
what is a share or a decision (the replayed fractions, whether replay is active, the step counts, which every
rank takes alike) is the mean over ranks; `replay/staleness` is the mean age of every rank's replayed rows,
logged only on steps that replayed (Lightning would write its last value on the others).
`timing/*` stay this rank's seconds (rank 0's are the ones logged).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer

from exgrpo_pl.callbacks import placement
from exgrpo_pl.callbacks.collectives import totals_and_means
from exgrpo_pl.lightning_internals import forget_step_metrics

# Logged only on the steps they describe: a step without them must not repeat an earlier step's value.
REPLAYED_ONLY = ("replay/staleness",)
# Logged from a module's training_step on the steps with replayed rows (`ReplayMixin.replay_loss`).
MODULE_REPLAYED_ONLY = ("train/is_weight",)


def replay_metrics(callback, trainer: Trainer, rollouts) -> dict[str, float]:
    """The step's `replay/*` metrics over all ranks, and this rank's `timing/replay_*`; every rank must call
    it on the same steps (it all-reduces). On a step that replayed nothing, `REPLAYED_ONLY` metrics logged
    on an earlier step are left out of what Lightning writes, and so are the `MODULE_REPLAYED_ONLY` ones a
    module logged from `training_step` when this rank's rows have no replayed one.

    Args:
        callback: the `ReplayCallback`.
        trainer: the running trainer.
        rollouts: the `RolloutBatch` this rank trained on in the step.
    """
    replayed = rollouts.replayed
    questions = rollouts.question_ids.unique().numel()
    buffer = callback.buffer
    totals: dict[str, Any] = {
        "replay/buffer_size": len(buffer),
        "replay/retired": len(buffer.bucketer.retired),
        **{
            f"replay/stored_by_tier_{tier}": n
            for tier, n in enumerate(buffer.stats()["tier_counts"].tolist())
        },
        "stale_steps": float((trainer.global_step - rollouts.policy_version[replayed].float()).sum()),
        "stale_rows": int(replayed.sum()),
    }
    if callback.placement != "displace":  # one stored row in each joined or refilled group
        totals[placement.GROUPS_METRIC[callback.placement]] = int(replayed.sum())
    if callback.defers:  # waiting: where the datamodule says (PromptDataModule.deferred_waiting)
        waiting = getattr(trainer.datamodule, "deferred_waiting", None)
        if waiting is not None:
            totals["replay/deferred_questions"] = waiting
        totals["replay/deferred_total"] = callback.deferred_total
    means = {
        # Whether this step could replay: the triggers hold and the buffer holds min_buffer_size.
        "replay/active": float(callback.replay_active(trainer) and len(buffer) >= callback.min_buffer_size),
        # A mixed group is one stored row and K-1 fresh ones: the share of questions is what mix_fraction
        # sets, the share of rows what the loss sees.
        "replay/question_fraction": rollouts.question_ids[replayed].unique().numel() / max(questions, 1),
        "replay/row_fraction": replayed.float().mean().item(),
        "replay/fallback_steps": callback.fallback_steps,
        "replay/replayed_steps": callback.replayed_steps,
        "replay/forced_fresh_steps": callback.forced_fresh_steps,
    }
    metrics = totals_and_means(trainer, totals, means)
    stale_steps, stale_rows = metrics.pop("stale_steps"), metrics.pop("stale_rows")
    if stale_rows:
        metrics["replay/staleness"] = stale_steps / stale_rows
    forget_step_metrics(
        trainer, "on_train_batch_end", [name for name in REPLAYED_ONLY if name not in metrics]
    )
    if not bool(replayed.any()):
        forget_step_metrics(trainer, "training_step", MODULE_REPLAYED_ONLY)
    return {**metrics, **callback.last_timings}

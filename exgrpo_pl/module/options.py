"""ExGRPOModule's options that have a range or a set of choices, checked when the module is built, i.e.
before any training starts.
"""

from __future__ import annotations

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from exgrpo_pl.engines import check_engine
from exgrpo_pl.models import DTYPES
from exgrpo_pl.step.losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    OFF_POLICY_CORRECTIONS,
    SCALE_REWARDS,
)
from exgrpo_pl.step.refill import DYNAMIC_SAMPLING
from exgrpo_pl.validation import check_choice, check_number, check_numbers

NUMERIC_OPTIONS = {
    "reward_timeout_seconds": dict(low=0, low_open=True, optional=True),
    "num_generations": dict(low=2, integer=True),
    "max_prompt_length": dict(low=1, integer=True),
    "max_completion_length": dict(low=1, integer=True),
    "temperature": dict(low=0, low_open=True),
    "top_p": dict(low=0, high=1, low_open=True),
    "epsilon": dict(low=0),
    "epsilon_high": dict(low=0, optional=True),
    "delta": dict(low=1, low_open=True, optional=True),  # the ratio is 1 before any update
    "num_iterations": dict(low=1, integer=True),
    "steps_per_generation": dict(low=1, integer=True),
    "beta": dict(low=0),
    "entropy_coef": dict(low=0),
    "entropy_token_budget": dict(low=1, integer=True, optional=True),
    "learning_rate": dict(low=0, high=1, low_open=True),  # AdamW moves each weight by up to lr a step
    "weight_decay": dict(low=0),
    "warmup_steps": dict(low=0, integer=True),
    "max_grad_norm": dict(low=0),
    "skip_grad_norm": dict(low=0, low_open=True, optional=True),
    "max_nonfinite_steps": dict(low=1, integer=True),
    "micro_batch_size": dict(low=1, integer=True, optional=True),
    "logit_chunk_elements": dict(low=1, integer=True),
    "correct_threshold": dict(),
    "shaping_beta": dict(low=0, low_open=True),
    "is_truncation": dict(low=0, low_open=True),
    "val_temperature": dict(low=0, optional=True),
    "val_num_generations": dict(low=1, integer=True),
    "refill_fraction": dict(low=0, high=1, low_open=True),
    "max_generation_rounds": dict(low=1, integer=True),
}
"""Every numeric option and its range; each must also be finite."""
CHOICE_OPTIONS = {
    "loss_type": LOSS_TYPES,
    "scale_rewards": SCALE_REWARDS,
    "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "off_policy_correction": OFF_POLICY_CORRECTIONS,
    "dtype": tuple(DTYPES),
    "dynamic_sampling": DYNAMIC_SAMPLING,
}


def check_options(hp) -> None:
    """Reject impossible settings at construction, i.e. before any training starts."""
    check_numbers("ExGRPOModule", hp, NUMERIC_OPTIONS)
    for i, weight in enumerate(hp.reward_weights or []):
        check_number("ExGRPOModule", f"reward_weights[{i}]", weight)
    if hp.reward_weights and not any(hp.reward_weights):
        raise ValueError(
            f"ExGRPOModule reward_weights={list(hp.reward_weights)}: at least one must be non-zero; with all"
            " zero every reward is 0, every advantage is 0, and nothing is learned"
        )
    for name, allowed in CHOICE_OPTIONS.items():
        check_choice("ExGRPOModule", name, hp[name], allowed)
    if hp.importance_sampling_level == "sequence" and hp.loss_type in ("dapo", "dr_grpo"):
        rank_zero_warn(
            f"ExGRPOModule importance_sampling_level='sequence' with loss_type={hp.loss_type!r}: the loss "
            "sums token terms, so each completion weighs as much as it has tokens, not GSPO's per-sequence "
            "objective; set loss_type='grpo' for GSPO's setup"
        )
    check_engine(hp.rollout_engine, hp.rollout_engine_options)


def stream_for_dynamic_sampling(datamodule, mode: str) -> None:
    """Turns the datamodule's training stream on for dynamic sampling's further questions, or raises
    TypeError naming what it lacks (at setup, before any training)."""
    missing = [name for name in ("stream_passes", "draw_questions") if not hasattr(datamodule, name)]
    if missing:
        raise TypeError(
            f"ExGRPOModule dynamic_sampling={mode!r} draws further questions from the training stream, but "
            f"the datamodule {type(datamodule).__name__} has no {' or '.join(missing)}: use "
            "exgrpo_pl.data.PromptDataModule, or give yours `stream_passes()` (called at setup) and "
            "`draw_questions(n)` (the stream's next n questions as a training batch, counted as seen)"
        )
    datamodule.stream_passes()


def check_max_steps(max_steps: int, hp) -> None:
    """Rejects a `trainer.max_steps` that is not a whole number of batches: Lightning counts optimizer
    updates, a batch takes `num_iterations * steps_per_generation` of them, and it stops only between
    batches, so the run would take more updates than `max_steps` (and say it stopped at `max_steps`).

    Args:
        max_steps: the trainer's `max_steps` (-1: no limit).
        hp: the module's options.
    """
    per_batch = hp.num_iterations * hp.steps_per_generation
    if max_steps > 0 and max_steps % per_batch:
        below, above = max_steps // per_batch * per_batch, -(-max_steps // per_batch) * per_batch
        raise ValueError(
            f"trainer.max_steps={max_steps}: not a multiple of the {per_batch} optimizer updates each batch "
            f"takes (ExGRPOModule steps_per_generation={hp.steps_per_generation} x num_iterations="
            f"{hp.num_iterations}); the run would take {above}. Set max_steps to "
            + (f"{below} or {above}" if below else f"{above}")
        )

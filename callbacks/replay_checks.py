"""What `ReplayCallback` checks so that a replay that cannot happen is never silent.

- Invalid options, and contradictions its options show (a `min_buffer_size` above the buffer's `max_size`, a
  `replay_start_epoch` at or past the trainer's `max_epochs`, `displaced_questions="defer"` with a datamodule
  that cannot take questions back) are errors before training (`check_options`, `check_trainer`,
  `check_streams`).
- Contradictions that depend on the data (fewer rollouts in the whole run, or fewer storable trajectories,
  than `min_buffer_size`; `max_steps` ending the run before `replay_start_epoch`) are a warning when training
  starts, naming the numbers (`warn_if_unreachable`).
- A run whose replay phase began but that never replayed says so when training ends
  (`warn_if_never_replayed`).
- A resume with other replay options than the checkpoint's lists them, as the module does for its own
  (`options`, `warn_changed`; an option the checkpoint predates counts as its default, `defaults`); a
  checkpoint saved without a `ReplayCallback` is said to start replay afresh.
- A shape error in a swap step that handed the module fewer than B x K rows gets a note naming the cause
  (a reshape by K) and the fix (`note_short_swap_step`).

What the module itself hands over (completion masks, rewards, its training loader) is checked in
`exgrpo_pl.callbacks.module_checks`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from exgrpo_pl.callbacks import placement
from exgrpo_pl.callbacks.fill import FILL_FROM
from exgrpo_pl.contract import CONTRACT_DOC, REPLAY_MODES, ContractError
from exgrpo_pl.experience.sampling import OFFICIAL_PICK
from exgrpo_pl.validation import check_number

_PLAIN = (bool, int, float, str, type(None))
# Not compared on resume: the sampler's seed only starts its generators, and a resume restores their state.
_NOT_OPTIONS = {"self", "seed"}
STREAM_METHODS = ("stream_passes", "defer_questions")  # what displaced_questions="defer" needs
DISPLACED_QUESTIONS = ("discard", "defer")  # what becomes of the fresh questions a replay step displaces


def check_options(callback) -> None:
    """Raises ValueError naming the option when the callback's own options are invalid or rule replay out,
    before any trainer exists. `ReplayCallback` runs it on construction and again in `setup`, so an option
    set on the callback afterwards (as a script that adjusts a preset's callback does) is checked too."""
    name = "ReplayCallback"
    if callback.mode not in REPLAY_MODES:
        raise ValueError(f"{name} mode={callback.mode!r}; allowed: {', '.join(REPLAY_MODES)}")
    check_number(name, "mix_fraction", callback.mix_fraction, 0, 1, low_open=True)
    check_number(name, "replay_start_epoch", callback.replay_start_epoch, 0, integer=True, optional=True)
    check_number(name, "start_pass_rate", callback.start_pass_rate, 0, 1, optional=True)
    check_number(name, "min_buffer_size", callback.min_buffer_size, 1, integer=True)
    check_number(name, "max_consecutive_replay_steps", callback.max_consecutive_replay_steps, 1, integer=True)
    if callback.displaced_questions not in DISPLACED_QUESTIONS:
        raise ValueError(
            f"{name} displaced_questions={callback.displaced_questions!r}; allowed: "
            f"{', '.join(DISPLACED_QUESTIONS)}"
        )
    placement.check_options(callback)
    if callback.fill_from not in FILL_FROM:
        raise ValueError(f"{name} fill_from={callback.fill_from!r}; allowed: {', '.join(FILL_FROM)}")
    if callback.bounded_demand and callback.mode != "mix":
        raise ValueError(f"{name} bounded_demand=True needs mode='mix' (a swap replaces the whole batch)")
    replay, percentiles = callback.replay, callback.buffer.entropy_percentiles
    by_percentile = replay.trajectory_selection == "low_entropy_percentile"
    if by_percentile and replay.entropy_percentile not in percentiles:
        raise ValueError(
            f"SelectiveReplay entropy_percentile={replay.entropy_percentile} is not one of the "
            f"buffer's entropy_percentiles {list(percentiles)}"
        )
    if callback.min_buffer_size > callback.buffer.max_size:
        raise ValueError(
            f"{name} min_buffer_size={callback.min_buffer_size}: must be <= the buffer's "
            f"max_size={callback.buffer.max_size}, or replay can never start (the buffer never holds that"
            " many)"
        )


def check_trainer(callback, trainer) -> None:
    """Raises ValueError when the trainer's options rule replay out (call in `setup`)."""
    start, max_epochs = callback.replay_start_epoch, trainer.max_epochs
    if start is not None and max_epochs not in (None, -1) and start >= max_epochs:
        raise ValueError(
            f"ReplayCallback replay_start_epoch={start}: must be < trainer.max_epochs={max_epochs} (epochs"
            f" count from 0), or replay can never start; the run would be plain GRPO"
        )


def check_module(callback, module) -> None:
    """Raises `ContractError` in `on_fit_start` (before the first step) when what a replay step will read
    from the module is missing: the policy `score_entropy` runs (`replay_policy()`) and the temperature it
    samples at (`sampling_temperature()`), where the replay strategy rescores stored trajectories."""
    if not callback.replay.rescores:
        return
    if callback.replay.trajectory_selection == OFFICIAL_PICK and not callable(
        getattr(module, "score_official_entropy", None)
    ):
        raise ContractError(
            f"ReplayCallback's trajectory_selection={OFFICIAL_PICK!r} rescores stored trajectories with "
            f"the module's score_official_entropy(rollouts, num_forwards=None), which "
            f"{type(module).__name__} lacks: inherit exgrpo_pl.module.ReplayMixin, see {CONTRACT_DOC}"
        )
    for hook in ("replay_policy", "sampling_temperature"):
        read = getattr(module, hook, None)
        if not callable(read):
            continue
        try:
            read()
        except AttributeError as error:  # replay_policy's: no `policy` or `model`
            raise ContractError(
                f"{error}. ReplayCallback's strategy {callback.replay.strategy!r} rescores stored "
                f"trajectories with it at every replay step; see {CONTRACT_DOC}"
            ) from error


def note_short_swap_step(exception: BaseException, rows: int, full: int) -> None:
    """Adds the cause and the fix to a `RuntimeError` (torch's shape errors) raised in a swap replay step that
    handed `training_step` `rows` < `full` = B x K stored rows: torch's bare "shape '[-1, 4]' is invalid for
    input of size 6" does not say that a module's reshape by K (`view(-1, K)`) met a batch in groups of 1.
    A `ContractError` (a `ValueError`) already names its fix."""
    if not isinstance(exception, RuntimeError):
        return
    exception.add_note(
        f"ReplayCallback: this step was a swap replay step, which hands training_step only the {rows} stored"
        f" rows it replays, in groups of 1 (rollouts.group_size == 1), not batch_size x num_generations ="
        f" {full} rows in groups of K. A reshape by K, such as view(-1, K), fails on it: reshape by"
        " k = rollouts.group_size instead (K on other steps, 1 on a swap step). See 'Swap's shorter batches'"
        f" in {CONTRACT_DOC}."
    )


def check_mix_batch(callback, questions: int) -> None:
    """Raises ValueError when a mixed step would replay every question of a batch of one, though
    `mix_fraction` < 1 asks for a share: it would train on a stored trajectory and its K-1 rollouts only,
    never on a fresh question."""
    displaces = callback.mode == "mix" and callback.placement == "displace"  # join and refill keep them all
    if displaces and questions < 2 and callback.mix_fraction < 1:
        raise ValueError(
            f"ReplayCallback mode='mix' with training batches of {questions} question(s): a mixed step"
            " replays round(mix_fraction * B) questions and keeps at least one fresh, which needs"
            " batch_size >= 2. Raise the datamodule's batch_size, use mode='swap', or mix_fraction=1.0 to"
            " replay every question on purpose"
        )


def check_streams(datamodule) -> None:
    """Raises TypeError unless the datamodule can take back the questions a replay step displaces (call in
    `setup` under `displaced_questions="defer"`)."""
    missing = [name for name in STREAM_METHODS if not callable(getattr(datamodule, name, None))]
    if missing:
        what = "no datamodule" if datamodule is None else type(datamodule).__name__
        raise TypeError(
            f"ReplayCallback displaced_questions='defer' needs a datamodule with "
            f"{' and '.join(f'{name}()' for name in STREAM_METHODS)} (exgrpo_pl.data.PromptDataModule has"
            f" them), to hand the questions a replay step displaces back to its training stream; {what} has"
            f" no {', '.join(missing)}. Use displaced_questions='discard', or a PromptDataModule."
        )


def _batches_left(trainer) -> tuple[float, float]:
    """(training batches this run has left, of which the ones `max_steps` allows), either may be inf."""
    per_epoch = trainer.num_training_batches
    epochs = trainer.max_epochs
    by_epochs = math.inf if epochs in (None, -1) else per_epoch * (epochs - trainer.current_epoch)
    by_steps = math.inf
    if trainer.max_steps not in (None, -1):
        # max_steps counts optimizer updates, of which a batch may take several (`updates_per_batch`).
        updates = getattr(trainer.lightning_module, "updates_per_batch", 1)
        by_steps = (
            math.ceil((trainer.max_steps - trainer.global_step) / updates) * trainer.accumulate_grad_batches
        )
    return min(by_epochs, by_steps), by_steps


def warn_if_unreachable(callback, trainer, num_generations: int) -> None:
    """Warns, naming the numbers, when this run's data and length cannot fill the buffer to
    `min_buffer_size` or reach `replay_start_epoch` (call in `on_train_start`, once the loader is set up)."""
    batches, by_steps = _batches_left(trainer)
    per_epoch = trainer.num_training_batches
    start = callback.replay_start_epoch
    if start is not None and by_steps < math.inf and 0 < per_epoch < math.inf:
        last_epoch = trainer.current_epoch + math.ceil(by_steps / per_epoch) - 1
        if start > last_epoch:
            rank_zero_warn(
                f"ReplayCallback replay_start_epoch={start}, but trainer.max_steps={trainer.max_steps} ends"
                f" this run in epoch {last_epoch} ({per_epoch} batches an epoch): replay can never start"
            )
    questions = _batch_size(trainer)
    if questions is None or batches == math.inf:
        return
    rollouts = int(batches) * questions * num_generations
    storable = len(callback.buffer) + rollouts
    why = f"{int(batches)} batches x {questions} questions x {num_generations} generations = {rollouts}"
    pool = len(getattr(trainer.datamodule, "train_rows", ()))
    cap = callback.buffer.max_per_question
    if pool and cap is not None and pool * cap < storable:
        storable, why = pool * cap, f"{pool} training questions x max_per_question={cap}"
    if storable < callback.min_buffer_size:
        rank_zero_warn(
            f"ReplayCallback min_buffer_size={callback.min_buffer_size} trajectories per rank, but this run"
            f" can store at most {storable} on a rank ({why}, of which the buffer keeps only those its"
            f" keep={callback.buffer.keep!r} admits): replay can never start. Lower min_buffer_size."
        )


def _batch_size(trainer) -> int | None:
    """Questions per training batch on a rank, where the datamodule or the loader says."""
    hparams = getattr(trainer.datamodule, "hparams", None)
    if hparams is not None and isinstance(hparams.get("batch_size"), int):
        return hparams["batch_size"]
    return getattr(trainer.train_dataloader, "batch_size", None)


def warn_if_never_replayed(callback, trainer) -> None:
    """Warns when the replay phase began but no step replayed (call in `on_train_end`)."""
    if not callback.replay_active(trainer) or callback.replayed_steps:
        return
    why = (
        " placement='join' replays only questions of the batch that the buffer already holds, which a single"
        " pass over the data never has."
        if callback.placement == "join"
        else ""
    )
    rank_zero_warn(
        f"ReplayCallback: replay was active, but no step of this run replayed ({callback.fallback_steps}"
        f" steps fell back to on-policy): the buffer holds {len(callback.buffer)} trajectories on this rank"
        f" against min_buffer_size={callback.min_buffer_size}.{why} The run was plain GRPO."
    )


def _owners(callback) -> tuple[tuple[str, Any], ...]:
    return (
        ("", callback),
        ("buffer.", callback.buffer),
        ("buffer.bucketer.", callback.buffer.bucketer),
        ("replay.", callback.replay),
    )


def defaults(callback) -> dict[str, Any]:
    """The default of each option of `options` that has a plain one, under the same names."""
    found: dict[str, Any] = {}
    for prefix, owner in _owners(callback):
        for name, parameter in inspect.signature(type(owner).__init__).parameters.items():
            if name not in _NOT_OPTIONS and isinstance(parameter.default, _PLAIN):
                found[prefix + name] = parameter.default
    return found


def options(callback) -> dict[str, Any]:
    """The callback's options and those of its buffer, bucketer and replay sampler, flat and primitive:
    `{"mode": "mix", "buffer.max_size": 100000, "buffer.bucketer.window_size": 8, ...}`."""
    found: dict[str, Any] = {}
    for prefix, owner in _owners(callback):
        for name in inspect.signature(type(owner).__init__).parameters:
            value = getattr(owner, name, None)
            if isinstance(value, (list, tuple)) and all(isinstance(v, _PLAIN) for v in value):
                value = list(value)
            if name not in _NOT_OPTIONS and hasattr(owner, name) and isinstance(value, (*_PLAIN, list)):
                found[prefix + name] = value
    return found


def warn_changed(
    saved: dict[str, Any] | None, current: dict[str, Any], default: dict[str, Any] | None = None
) -> None:
    """Warns, listing them, when the replay options of this run differ from a checkpoint's (`options`);
    a checkpoint from before options were saved (`saved` None) is not compared, and an option missing from
    `saved` (the checkpoint predates it) is compared as its `default` value (`defaults`), the behaviour the
    saved run had."""
    if saved is None:
        return
    saved = {**(default or {}), **saved}
    lines = [
        f"{name}: {saved.get(name)!r} in the checkpoint, {value!r} in this run"
        for name, value in current.items()
        if saved.get(name) != value
    ]
    if lines:
        rank_zero_warn(
            f"Resuming: {len(lines)} ReplayCallback option(s) differ from the checkpoint's, and this run uses"
            " its own values (so it does not continue the saved run exactly):\n  " + "\n  ".join(lines)
        )


def warn_if_saved_without(callback, checkpoint: dict) -> None:
    """Warns when resuming from a checkpoint that holds no state of this callback."""
    if callback.state_key not in checkpoint.get("callbacks", {}):
        rank_zero_warn(
            "Resuming with a ReplayCallback from a checkpoint saved without one: its buffer starts empty,"
            " and replay's start conditions (replay_start_epoch, start_pass_rate) are judged afresh"
        )

"""What `ReplayCallback` checks in the parts a GRPO module of one's own brings, where a mistake would
otherwise train silently or replay nothing, each naming the fix:

- completion masks: True after the first EOS (padding trained on, `check_completion_mask`), or False on the
  EOS in every row that ends with one (the EOS never trained, `check_eos_trained`); checked on the first
  step of each kind, with the module's EOS ids (`eos_token_ids`);
- rewards: a run whose fresh rows all had a reward of exactly 0 (a module that scores after its forward and
  leaves the sampler's rewards unfilled) warns when it ends (`note_rewards`, `warn_if_rewards_all_zero`);
- the training loader: one that a resumed run cannot continue exactly (no saved position, or one that draws
  from the global generator the callback restores) warns when training starts
  (`warn_if_loader_cannot_resume`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch.utilities import rank_zero_warn

from exgrpo_pl.batch import RolloutBatch
from exgrpo_pl.checkpoints.resume import warn_if_loader_not_restored
from exgrpo_pl.contract import CONTRACT_DOC, ContractError
from exgrpo_pl.module.resumable import ResumableModule


def eos_token_ids(module) -> list[int]:
    """The ids that end a completion for `module`: its `eos_token_ids`, else its tokenizer's `eos_token_id`
    (none known: an empty list, and the completion-mask check is skipped)."""
    ids = getattr(module, "eos_token_ids", None)
    if ids is None:
        ids = getattr(getattr(module, "tokenizer", None), "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]


def check_completion_mask(rollouts: RolloutBatch, eos_token_ids: list[int]) -> None:
    """Raise a `ContractError` when a fresh row's `completion_mask` is True after its first EOS token.

    Tokens after EOS are padding: in the mask they enter the loss, the stored entropy and the buffer (a
    replayed row's padding weighted as if sampled). No ids (unknown EOS): nothing is checked.
    """
    if not eos_token_ids or not len(rollouts):
        return
    ids, mask = rollouts.completion_ids, rollouts.completion_mask  # [N, C]
    is_eos = torch.isin(ids, torch.tensor(eos_token_ids, device=ids.device)) & mask  # [N, C]
    after = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # [N, C] past the row's first EOS
    bad = ((after & mask).any(1) & ~rollouts.replayed).nonzero().flatten().tolist()
    if bad:
        padded = int((after & mask)[bad].sum())
        raise ContractError(
            f"rollouts.completion_mask is True after the EOS token (ids {eos_token_ids}) in rows {bad[:8]} "
            f"({padded} tokens): the padding after EOS would be trained on, counted in the entropy and "
            "stored for replay. Mask up to and including the first EOS: is_eos = completion_ids == "
            f"eos_token_id; completion_mask = is_eos.cumsum(1) - is_eos.long() == 0 (see {CONTRACT_DOC})"
        )


def check_eos_trained(rollouts: RolloutBatch, eos_token_ids: list[int]) -> None:
    """Raise a `ContractError` when no fresh row that ends with an EOS token has that token in its
    `completion_mask` (a mask that stops before EOS): the EOS is then never trained, nor stored with its
    log-prob, and the policy is never taught to stop. Checked on steps without replayed rows only, where a
    row is padded to the width of its own step: a truncated row padded to a stored row's width, with a pad
    token that is the EOS, would look the same."""
    if not eos_token_ids or not len(rollouts) or bool(rollouts.replayed.any()):
        return
    ids, mask = rollouts.completion_ids, rollouts.completion_mask  # [N, C]
    is_eos = torch.isin(ids, torch.tensor(eos_token_ids, device=ids.device))  # [N, C]
    first = is_eos & (is_eos.long().cumsum(1) == 1)  # [N, C] each row's first EOS
    ends = first.any(1)  # [N]
    if not bool(ends.any()) or bool((first & mask).any()):
        return
    rows = ends.nonzero().flatten().tolist()
    raise ContractError(
        f"rollouts.completion_mask is False on the EOS token (ids {eos_token_ids}) that ends rows {rows[:8]}"
        f" ({len(rows)} rows), in every row that has one: the EOS is never trained (the policy is not taught"
        " to stop) and is stored for replay without its log-prob. Mask up to and including the first EOS:"
        " is_eos = completion_ids == eos_token_id; completion_mask = is_eos.cumsum(1) - is_eos.long() == 0"
        f" (see {CONTRACT_DOC})"
    )


def warn_if_loader_cannot_resume(trainer, module) -> None:
    """Warns, naming the fix, when the run writes or resumes checkpoints and a resumed run would train on
    other batches or samples than the uninterrupted one (call in `on_train_start`, once the training loader
    is set up): the loader has no `state_dict`/`load_state_dict` (Lightning saves no position in it, and a
    resume from the middle of an epoch starts the epoch over), or it has no generator of its own (creating
    its iterator draws a seed from torch's global generator, which the callback restores: the draw then
    falls elsewhere in a resumed run, and so do the module's samples). On a resume, a module without
    `ExGRPOModule`'s own check also gets `warn_if_loader_not_restored`'s warning: a loader set up before the
    checkpoint was restored never gets its saved position."""
    if not trainer.checkpoint_callbacks and trainer.ckpt_path is None:
        return
    if trainer.ckpt_path is not None and not isinstance(module, ResumableModule):
        warn_if_loader_not_restored(trainer)
    loaders = trainer.train_dataloader
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )
        global_seed = hasattr(loader, "generator") and loader.generator is None
        if stateful and not global_seed:
            continue
        why = []
        if not stateful:
            why.append(
                f"it is a {type(loader).__name__} without state_dict()/load_state_dict(), so Lightning saves"
                " no position in it and a run resumed from a checkpoint saved mid-epoch starts the epoch's"
                " batches over"
            )
        if global_seed:
            why.append(
                "it has no generator of its own, so creating its iterator draws a seed from torch's global"
                " generator, which ReplayCallback restores on resume: the draw falls elsewhere and the"
                " rollouts sampled after a resume differ"
            )
        rank_zero_warn(
            f"ReplayCallback: a resumed run will not continue this one exactly, because of the training"
            f" loader: {'; and '.join(why)}. Use torchdata.stateful_dataloader.StatefulDataLoader (the same"
            " arguments) with a generator of its own, e.g. StatefulDataLoader(dataset, batch_size=B,"
            " shuffle=True, collate_fn=..., generator=torch.Generator().manual_seed(seed)), or"
            " exgrpo_pl.data.PromptDataModule; see 'Resume' in "
            f"{CONTRACT_DOC}"
        )
        return


def note_rewards(callback, rollouts: RolloutBatch) -> None:
    """Counts the step's fresh rows and whether any had a nonzero reward (`warn_if_rewards_all_zero`)."""
    fresh = ~rollouts.replayed
    callback._fresh_rows_seen += int(fresh.sum())
    if not callback._nonzero_reward_seen and bool(fresh.any()):
        callback._nonzero_reward_seen = bool(rollouts.rewards[fresh].ne(0).any())


def warn_if_rewards_all_zero(callback) -> None:
    """Warns when every fresh row of the run had a reward of exactly 0 (call in `on_train_end`)."""
    if callback._nonzero_reward_seen or not callback._fresh_rows_seen:
        return
    rank_zero_warn(
        f"ReplayCallback: every one of the {callback._fresh_rows_seen} fresh rows this run returned had a"
        " reward of exactly 0, so no row was correct and replay, which draws correct rows only, had nothing"
        " to replay. If the module scores its rollouts after its forward, the rewards the callback reads"
        " (rollouts.rewards, from the sampler) were never filled: score in the sampler, which returns the"
        f" rewards (or each reward function's, by name); see {CONTRACT_DOC}. If the task is simply this hard"
        " for the model, replay has nothing to store yet."
    )

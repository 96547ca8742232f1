"""What ExGRPOModule keeps in its checkpoints besides its weights (token counts, every rank's sampling RNG)
and what it does on resuming from one (see `exgrpo_pl.checkpoints.resume`).
"""

from __future__ import annotations

import torch

from exgrpo_pl.checkpoints.integrity import check_restored_finite
from exgrpo_pl.checkpoints.resume import (
    restore_rng_states,
    resumable_fit_progress,
    rng_states,
    settle_resumed_step_count,
    use_run_optimizer_options,
    warn_changed_options,
    warn_if_loader_not_restored,
)
from exgrpo_pl.lightning_internals import attached_trainer


class ResumableModule:
    """`ExGRPOModule`'s checkpoint hooks and the resume's settling in `on_train_start`.

    Reads the module's `hparams`, `trainer`, `num_tokens`, `generated_tokens`, `nonfinite`,
    `best_val_pass_at_1` and `val_curve`.
    """

    def _resume_on_train_start(self) -> None:
        """Finite restored weights, the resumed run's own learning rate and weight decay, and the step
        count Lightning miscounts. Call in `on_train_start`."""
        if self.trainer.ckpt_path is not None:
            check_restored_finite(self.trainer, self)
        warn_if_loader_not_restored(self.trainer)
        if self.trainer.ckpt_path is not None:  # a resumed run keeps its own options, these two included
            scheduler = self.trainer.lr_scheduler_configs[0].scheduler
            use_run_optimizer_options(
                self.trainer.optimizers[0], scheduler, self.hparams.learning_rate, self.hparams.weight_decay
            )
        if getattr(self, "_resumed_at", None) == "epoch end":
            settle_resumed_step_count(self.trainer)
            self._resumed_at = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["token_counts"] = {
            "num_tokens": self.num_tokens,
            "generated_tokens": self.generated_tokens,
            "nonfinite_steps": self.nonfinite.skipped,
            "grad_norm_skips": self.nonfinite.too_large,
        }
        checkpoint["best_val_pass_at_1"] = self.best_val_pass_at_1  # a resumed run's best is the run's
        checkpoint["val_curve"] = [list(point) for point in self.val_curve]  # and so is its curve
        # The sampling RNG of every rank (CPU and CUDA), so that a resumed run generates what the
        # uninterrupted run would have.
        checkpoint["sampling_rng"] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        counts = checkpoint.get("token_counts", {})
        self.num_tokens = counts.get("num_tokens", 0)
        self.generated_tokens = counts.get("generated_tokens", 0)
        self.nonfinite.skipped = counts.get("nonfinite_steps", 0)
        self.nonfinite.too_large = counts.get("grad_norm_skips", 0)
        self.best_val_pass_at_1 = checkpoint.get("best_val_pass_at_1", 0.0)
        self.val_curve = tuple((int(step), float(value)) for step, value in checkpoint.get("val_curve", []))
        trainer = attached_trainer(self)  # None in load_from_checkpoint
        if trainer is not None:
            warn_changed_options(checkpoint, self, trainer.datamodule, trainer.ckpt_path)
        # Lightning restores the loops after this hook; on_train_start settles what it then miscounts.
        self._resumed_at = resumable_fit_progress(checkpoint)
        states = checkpoint.get("sampling_rng")
        if isinstance(states, dict):
            restore_rng_states(states)
        elif states is not None:  # a checkpoint from before per-rank states: rank 0's CPU state
            torch.set_rng_state(states)

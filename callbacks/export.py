"""ExportPolicy: when training ends, the policy as a Hugging Face model folder, ready for vLLM or the Hub.

    exgrpo fit --config configs/quickstart.yaml \\
        --trainer.callbacks+=exgrpo_pl.callbacks.ExportPolicy --trainer.callbacks.dirpath=runs/policy

It exports the checkpoint `SafeModelCheckpoint` saves when training ends (with `export_policy`, as
`exgrpo export` does), so a DeepSpeed run's shards are consolidated from that folder, not gathered in memory.
A run stopped by an exception exports nothing; `exgrpo export` exports any checkpoint later.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from exgrpo_pl.checkpoints.export import check_replaceable, export_policy
from exgrpo_pl.checkpoints.saving import SafeModelCheckpoint


class ExportPolicy(Callback):
    """Writes the final policy to `dirpath` once `fit` ends (rank 0), replacing a folder there.

    Args:
        dirpath: the model folder to write (safetensors, config, tokenizer, generation config).
        merge_lora: for a LoRA run, the base model with the adapter merged in instead of the adapter alone.
    """

    def __init__(self, dirpath: str, merge_lora: bool = False) -> None:
        self.dirpath, self.merge_lora = dirpath, merge_lora

    def _checkpoint(self, trainer: Trainer) -> SafeModelCheckpoint | None:
        return next((c for c in trainer.checkpoint_callbacks if isinstance(c, SafeModelCheckpoint)), None)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # Before training, not after hours of it: without this checkpoint there would be nothing to export.
        if stage == "fit" and self._checkpoint(trainer) is None:
            raise ValueError(
                f"ExportPolicy(dirpath={self.dirpath!r}) exports the checkpoint SafeModelCheckpoint saves "
                "when training ends, and the trainer has none: add exgrpo_pl.checkpoints.SafeModelCheckpoint "
                "to its callbacks (`exgrpo fit` adds one unless checkpointing is off or another one is set)"
            )
        if stage == "fit":
            check_replaceable(self.dirpath)  # a folder of other files is refused now, not after training

    @override
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # on_fit_end, not on_train_end: Lightning runs checkpoint callbacks' on_train_end after the others'.
        if not trainer.is_global_zero:
            return
        checkpoint = self._checkpoint(trainer)
        if not checkpoint.last_checkpoint_saved or checkpoint.last_global_step_saved != trainer.global_step:
            rank_zero_warn(
                f"ExportPolicy: no checkpoint of the last step ({trainer.global_step}) to export, so "
                f"{self.dirpath} was not written (a sanity check or fast_dev_run saves none)"
            )
            return
        out = export_policy(checkpoint.last_checkpoint_saved, self.dirpath, self.merge_lora, overwrite=True)
        print(f"  policy:      {out} (a Hugging Face model folder)")

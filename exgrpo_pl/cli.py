"""`exgrpo`: the LightningCLI of exgrpo-pl (fit / validate / test, YAML configs, callbacks by class_path).

exgrpo fit --config configs/quickstart.yaml
exgrpo fit --config configs/quickstart.yaml --print_config
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule


class ExGRPOCLI(LightningCLI):
    """LightningCLI that ends a fit by saying where its logs and checkpoints are.

    (The module itself checks the strategy against the trainer in `setup`, so plain `Trainer` runs get the
    same check.)
    """

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines = ["", "Training finished."]
        if trainer.logger is not None and trainer.logger.log_dir:
            lines.append(f"  logs:        {trainer.logger.log_dir}")
            root = getattr(trainer.logger, "root_dir", trainer.logger.save_dir)
            lines.append(f"  dashboards:  tensorboard --logdir {root}")
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None:
            path = checkpoint.best_model_path or checkpoint.last_model_path
            if path:
                lines.append(f"  checkpoint:  {path}")
        print("\n".join(lines))


def main(args=None) -> None:
    ExGRPOCLI(
        ExGRPOModule,
        PromptDataModule,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        args=args,
    )


if __name__ == "__main__":
    main()

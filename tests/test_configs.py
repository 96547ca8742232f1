"""Every shipped YAML parses with the CLI and builds its trainer, module, datamodule and callbacks."""

from pathlib import Path

import pytest
from exgrpo_pl.callbacks import ReplayCallback

from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert {"quickstart.yaml", "grpo_baseline.yaml", "exgrpo_paper.yaml", "exgrpo_seed.yaml"} <= {
        c.name for c in CONFIGS
    }


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_config_builds(config, tmp_path):
    cli = ExGRPOCLI(
        ExGRPOModule,
        PromptDataModule,
        run=False,
        args=["--config", str(config), f"--trainer.default_root_dir={tmp_path}"],
    )
    assert isinstance(cli.model, ExGRPOModule) and isinstance(cli.datamodule, PromptDataModule)
    replay = [c for c in cli.trainer.callbacks if isinstance(c, ReplayCallback)]
    assert len(replay) == (0 if config.name == "grpo_baseline.yaml" else 1)


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  loss_type: ppo\n")
    with pytest.raises(ValueError, match="loss_type='ppo'; allowed: grpo, dr_grpo, dapo"):
        ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=["--config", str(bad)])

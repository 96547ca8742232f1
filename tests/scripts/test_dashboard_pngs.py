"""scripts/dashboard_pngs.py draws every picture of docs/dashboards.md from a run of the current code, and
every tag such a run logs has a row on that page."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
from conftest import tiny_module
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from exgrpo_pl.callbacks import DifficultyMonitor, ReplayCallback
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.experience import SelectiveReplay

ROOT = Path(__file__).parents[2]
PICTURES = ROOT / "docs" / "dashboards"


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def undocumented(tags, page):
    """The tags no row of the dashboards page names (`{i}`, `{p}`, `/<domain>` and `/*` as patterns)."""
    documented = set(re.findall(r"`((?:train|val|replay|monitor|timing)/[^`]*)`", page))
    patterns = [
        re.escape(tag).replace(r"\{i\}", r"\d+").replace(r"\{p\}", r"\d+").replace("/<domain>", "/.+")
        for tag in documented
    ]
    patterns += [re.escape(tag[:-1]) + ".+" for tag in documented if tag.endswith("*")]
    # One per reward function, and TRL's completion statistics (a row names them together); Lightning's epoch.
    patterns += [r"train/rewards/.+/mean", r"train/completions/.+", "epoch"]
    return [tag for tag in tags if not any(re.fullmatch(p, tag) for p in patterns)]


def test_the_script_draws_every_picture_from_a_run_of_the_current_code(tmp_path, tiny_model_dir):
    seed_everything(0)
    replay = ReplayCallback(
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0), mode="mix", min_buffer_size=1
    )
    logger = TensorBoardLogger(tmp_path, name="tb", default_hp_metric=False)  # as the exgrpo command
    trainer = Trainer(
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[replay, DifficultyMonitor(log_every_n_steps=2)],
    )
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(tiny_module(tiny_model_dir), data)
    script = load("dashboard_pngs")
    assert script.draw(Path(logger.log_dir), tmp_path / "out", dpi=40) == 0  # 1: a picture's tag is missing
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "scalars.png",
        "monitor_histograms.png",
        "heatmap.png",
        "validation_curve.png",
        "run.json",
    }
    record = json.loads((tmp_path / "out" / "run.json").read_text())
    tags = [*record["scalars"], *record["histograms"], *record["images"]]
    assert "replay/question_fraction" in tags and "monitor/difficulty_entropy_heatmap" in tags
    assert not undocumented(tags, (ROOT / "docs" / "dashboards.md").read_text())


@pytest.mark.parametrize(
    "name", ["scalars.png", "monitor_histograms.png", "heatmap.png", "validation_curve.png"]
)
def test_the_pages_pictures_are_in_the_repository(name):
    assert f"](dashboards/{name})" in (ROOT / "docs" / "dashboards.md").read_text()
    assert (PICTURES / name).stat().st_size > 0


def test_the_pictures_are_of_the_readmes_quickstart_run():
    """docs/dashboards/run.json, written with the pictures, holds the validation curve of the run they were
    drawn from: getting-started.md's quickstart sentence (portable kernels), which scripts/check_quickstart.py
    holds to the current code, so the pictures are of a run of the current code."""
    run = json.loads((PICTURES / "run.json").read_text())
    claim = load("check_quickstart").claim(native=False)
    curve = run["val/pass@1"]
    step, best = max(curve[1:], key=lambda point: point[1])
    assert run["command"].startswith(
        "ATEN_CPU_CAPABILITY=default exgrpo fit --config configs/quickstart.yaml"
    )
    assert (round(curve[0][1], 3), round(curve[-1][1], 3)) == (claim["start"], claim["final"])
    assert (round(best, 3), step) == (claim["best"], claim["step"])

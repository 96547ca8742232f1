"""The analysis notebooks and the dashboard screenshot script, run headless against a tiny real run.

    python -m pytest tests/notebooks -m slow     # needs nbclient, nbformat, ipykernel

The slow tests train a few steps of configs/quickstart.yaml (replay forced on early, the DifficultyMonitor
logging every step, a checkpoint saved), execute both notebooks on it with nbclient and run
scripts/dashboard_pngs.py on it. The fast test checks that the notebooks are saved clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).parents[2]
NOTEBOOKS = ("buffer_analysis.ipynb", "grpo_vs_exgrpo.ipynb")


def make_tiny_run(root: Path, steps: int = 10) -> Path:
    """A few steps of the quickstart under `root`; returns its `lightning_logs` folder.

    180 training questions in batches of 32 make epochs of 5 steps, so the heatmap is logged; replay starts
    once a batch has any correct answer (the quickstart waits for a pass rate of 0.35) and 8 trajectories
    are stored, then mixes experience into every step.
    """
    import torch

    from exgrpo_pl.callbacks import DifficultyMonitor, ReplayCallback
    from exgrpo_pl.cli import ExGRPOCLI
    from exgrpo_pl.data import PromptDataModule
    from exgrpo_pl.module import ExGRPOModule

    args = [
        "--config", str(ROOT / "configs" / "quickstart.yaml"),
        f"--trainer.max_steps={steps}", "--trainer.val_check_interval=4", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={root}", "--data.synthetic.init_args.num_questions=200",
        "--data.val_fraction=0.1",
    ]  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # stay small next to whatever else runs on the machine
    try:
        with mock.patch.object(sys, "argv", sys.argv[:1]):  # pytest's own arguments are not the CLI's
            cli = ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)
        for callback in cli.trainer.callbacks:
            if isinstance(callback, ReplayCallback):
                callback.start_pass_rate = 0.0
            elif isinstance(callback, DifficultyMonitor):
                callback.log_every_n_steps = 1
                callback.completion_table_every_n_steps = 2
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        torch.set_num_threads(threads)
    logs = root / "lightning_logs"
    assert list(logs.glob("*/checkpoints/*.ckpt")), "the tiny run saved no checkpoint"
    return logs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    pytest.importorskip("nbclient")  # skip before training, not after
    pytest.importorskip("nbformat")
    return make_tiny_run(tmp_path_factory.mktemp("tiny-run"))


def execute(name: str, env: dict[str, str], workdir: Path) -> None:
    """Run every cell of notebooks/`name` in a fresh kernel (cwd notebooks/); a cell error raises."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the kernel inherits the environment of the process that starts it
    os.environ["MPLBACKEND"] = os.environ.get("MPLBACKEND") or "Agg"
    try:
        client = nbclient.NotebookClient(
            notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
        )
        client.execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    errors = [
        o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors, errors


@pytest.mark.slow
def test_buffer_analysis_notebook_runs_on_a_tiny_run(tiny_run):
    execute("buffer_analysis.ipynb", {"EXGRPO_RUN_DIR": str(tiny_run)}, ROOT / "notebooks")


@pytest.mark.slow
def test_grpo_vs_exgrpo_notebook_runs_on_a_tiny_results_file(tmp_path):
    def seed_run(seed, offset, tokens_per_step):
        curve = [(step, step * tokens_per_step, 0.27 + offset * step / 40) for step in (0, 20, 40)]
        replays = [5, 3, 1] if tokens_per_step < 1000 else []
        diagnostics = {"replays": sum(replays), "distinct_questions": len(replays), "top_tenth_share": 0.5,
                       "max_replays_per_question": max(replays, default=0), "replays_per_question": replays,
                       "replayed": [], "buckets": []}  # fmt: skip
        return {"seed": seed, "curve": curve, "diagnostics": diagnostics}

    variants = (("GRPO", 0.1, 1000), ("ExGRPO paper", 0.08, 900), ("ExGRPO swap", 0.12, 700))
    seeds = {name: [seed_run(s, off + s / 100, tokens) for s in (0, 1)] for name, off, tokens in variants}
    runs = {task: seeds for task in ("arithmetic", "reasoning")}
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from learning import summarise  # the benchmark's own summary, so the file has its real layout

    path = tmp_path / "learning_tiny.json"
    path.write_text(json.dumps({"summary": summarise(runs), "runs": runs}))
    execute("grpo_vs_exgrpo.ipynb", {"EXGRPO_LEARNING_JSON": str(path)}, ROOT / "notebooks")


@pytest.mark.slow
def test_dashboard_pngs_renders_three_images_from_a_tiny_run(tiny_run, tmp_path):
    out = tmp_path / "dashboards"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "dashboard_pngs.py"), "--run-dir", str(tiny_run),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "MPLBACKEND": "Agg"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "no scale text" not in done.stdout  # the heatmap's axes carry the monitor's numbers
    for name in ("scalars.png", "monitor_histograms.png", "heatmap.png"):
        png = out / name
        assert png.is_file() and png.stat().st_size > 0, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_valid_nbformat_4_without_outputs(name):
    notebook = json.loads((ROOT / "notebooks" / name).read_text())
    assert notebook["nbformat"] == 4
    assert notebook["cells"] and notebook["cells"][0]["cell_type"] == "markdown"
    for cell in notebook["cells"]:
        assert cell["cell_type"] in {"markdown", "code", "raw"}
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [], f"{name}: a code cell has saved outputs"
            assert cell["execution_count"] is None, f"{name}: a code cell has an execution count"

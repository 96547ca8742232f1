"""Every shipped YAML parses with the CLI and builds its trainer, module, datamodule and callbacks."""

import inspect
from pathlib import Path

import pytest
import yaml

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert {"quickstart.yaml", "grpo_baseline.yaml", "exgrpo_paper.yaml", "exgrpo_swap.yaml"} <= {
        c.name for c in CONFIGS
    }


def _real_model_overrides(config: Path, tiny_model_dir: str) -> list[str]:
    """For a preset of a hub model on GPUs: the local tiny model and one CPU, so nothing is downloaded.

    The DeepSpeed strategy is still built (it constructs on the CPU; only fitting needs CUDA).
    """
    raw = yaml.safe_load(config.read_text())
    if str(raw.get("model", {}).get("model_name_or_path", "embedded:")).startswith("embedded:"):
        return []
    if "DeepSpeed" in str(raw.get("trainer", {}).get("strategy", "")):
        pytest.importorskip("deepspeed")
    return [
        f"--model.model_name_or_path={tiny_model_dir}",
        "--model.chat_template=false",  # the tiny character tokenizer has no chat template
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
    ]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_config_builds(config, tmp_path, tiny_model_dir):
    cli = ExGRPOCLI(
        ExGRPOModule,
        PromptDataModule,
        run=False,
        args=[
            "--config",
            str(config),
            f"--trainer.default_root_dir={tmp_path}",
            *_real_model_overrides(config, tiny_model_dir),
        ],
    )
    assert isinstance(cli.model, ExGRPOModule) and isinstance(cli.datamodule, PromptDataModule)
    replay = [c for c in cli.trainer.callbacks if isinstance(c, ReplayCallback)]
    # GRPO, and the evaluation config, which trains nothing, have none.
    assert len(replay) == (0 if config.name in ("grpo_baseline.yaml", "eval_paper.yaml") else 1)
    if replay:  # the paper's recipes retire solved questions from the stream too, as its code does
        papers = config.name == "exgrpo_paper.yaml" or config.name.startswith("qwen")
        expected = "buffer_and_stream" if papers else "buffer"
        assert replay[0].buffer.bucketer.retire_from == expected


# What the paper's recipe is, beside its scale: the module's algorithm and the replay callback's choices.
PAPER_ALGORITHM = (
    "num_generations", "temperature", "loss_type", "scale_rewards", "epsilon", "num_iterations", "beta",
    "steps_per_generation", "clip_after_replay_starts", "off_policy_correction", "shaping_beta",
    "weight_decay",
)  # fmt: skip


@pytest.mark.parametrize("name", ["qwen2.5-math-1.5b_zero2.yaml", "qwen2.5-math-1.5b_zero3.yaml"])
def test_the_qwen_presets_run_the_paper_presets_algorithm(name):
    """The Qwen presets are configs/exgrpo_paper.yaml at the paper's scale: the same loss, updates per batch,
    clipping schedule, bucketing and replay; only sizes, the learning rate and the gradient clip differ."""
    paper, qwen = (yaml.safe_load((CONFIGS[0].parent / n).read_text()) for n in ("exgrpo_paper.yaml", name))
    model = qwen["model"]
    defaults = {k: v.default for k, v in inspect.signature(ExGRPOModule.__init__).parameters.items()}
    algorithm = [{k: p["model"].get(k, defaults[k]) for k in PAPER_ALGORITHM} for p in (paper, qwen)]
    assert algorithm[0] == algorithm[1]
    replay = [
        c["init_args"] for preset in (paper, qwen) for c in preset["trainer"]["callbacks"]
        if c["class_path"].endswith("ReplayCallback")
    ]  # fmt: skip
    for args in replay:
        del args["min_buffer_size"]  # per GPU, sized to the batch
    assert replay[0] == replay[1]
    # An update takes the official mini-batch, 64 rollouts per GPU; the official loss (a token sum over its
    # padded width, 8192) is 64 x 3072 / 8192 = 24 times ours (dr_grpo over those 64 rows and 3072 tokens):
    # its clip of 1.0 is 1/24 here, its entropy weight 0.001 per micro-batch 0.001 / 24 per M. The paper
    # preset pads to its own width: 0.001 / 64 there.
    rows = qwen["data"]["batch_size"] * model["num_generations"] / model["steps_per_generation"]
    scale = rows * model["max_completion_length"] / 8192
    assert (rows, scale) == (64, 24)
    assert model["max_grad_norm"] == 1 / scale and model["entropy_coef"] == 0.001 / scale
    assert paper["model"]["entropy_coef"] == 0.001 / 64
    assert model["entropy_token_budget"] == paper["model"]["entropy_token_budget"] == 32768


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  loss_type: ppo\n")
    with pytest.raises(ValueError, match="loss_type='ppo'; allowed: grpo, dr_grpo, dapo"):
        ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=["--config", str(bad)])


def test_quickstart_is_the_recommended_preset_on_the_reasoning_task():
    """configs/quickstart.yaml = configs/exgrpo.yaml with the reasoning task's model, reward, lengths, data
    and schedule (what benchmarks/learning.py lays over a preset for its "reasoning" task) and a
    DifficultyMonitor: so the learning benchmark's "ExGRPO recommended" runs on that task are quickstart
    runs, seed by seed."""
    configs = Path(__file__).parents[1] / "configs"
    quickstart, expected, task = (
        yaml.safe_load((configs / name).read_text())
        for name in ("quickstart.yaml", "exgrpo.yaml", "quickstart_reasoning.yaml")
    )
    for key in ("model_name_or_path", "reward_funcs", "max_completion_length", "val_num_generations"):
        expected["model"][key] = task["model"][key]
    expected["data"] = task["data"]
    for key in ("max_steps", "val_check_interval"):
        expected["trainer"][key] = task["trainer"][key]
    monitor = [c for c in quickstart["trainer"]["callbacks"] if c["class_path"].endswith("DifficultyMonitor")]
    assert len(monitor) == 1
    expected["trainer"]["callbacks"].append(monitor[0])
    assert quickstart == expected


def test_the_4x8_preset_is_the_8_gpu_preset_with_the_global_batch_kept():
    """On 32 GPUs the per-GPU sizes shrink by 4 and nothing else changes: the loss is normalised over every
    rank's rows, so the entropy weight and the gradient clip are the 8-GPU preset's."""
    one, four = (
        yaml.safe_load((CONFIGS[0].parent / f"qwen2.5-math-1.5b{n}_zero2.yaml").read_text())
        for n in ("", "_4x8")
    )
    gpus = [c["trainer"]["devices"] * c["trainer"]["num_nodes"] for c in (one, four)]
    assert gpus == [8, 32]
    assert [c["data"]["batch_size"] * g for c, g in zip((one, four), gpus)] == [128, 128]
    replay = [
        next(
            c["init_args"]
            for c in preset["trainer"]["callbacks"]
            if c["class_path"].endswith("ReplayCallback")
        )
        for preset in (one, four)
    ]
    assert [r.pop("min_buffer_size") * g for r, g in zip(replay, gpus)] == [512, 512]
    assert replay[0] == replay[1]
    # A rank holds a quarter of the official GPU's rows per update: a quarter of its token budget.
    budgets = [c["model"].pop("entropy_token_budget") for c in (one, four)]
    assert budgets == [32768, 8192]
    assert one["model"] == four["model"]
    assert {k: v for k, v in one["trainer"].items() if k != "num_nodes"} == {
        k: v for k, v in four["trainer"].items() if k != "num_nodes"
    }

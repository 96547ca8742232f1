"""The DeepSpeed presets parse and build their strategy on the CPU; conflicting configs fail early."""

import subprocess
import sys
from copy import deepcopy
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from exgrpo_pl.callbacks import ReplayCallback
from exgrpo_pl.cli import ExGRPOCLI
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.module.strategies import (
    check_strategy,
    hf_deepspeed_config,
    needs_synced_generation,
    zero_stage,
)

pytest.importorskip("deepspeed")
from lightning.pytorch.strategies import DeepSpeedStrategy  # noqa: E402

CONFIGS = Path(__file__).parents[2] / "configs"
PRESETS = {2: CONFIGS / "qwen2.5-math-1.5b_zero2.yaml", 3: CONFIGS / "qwen2.5-math-1.5b_zero3.yaml"}


def _cpu_overrides(tiny_model_dir, tmp_path):
    """Stand-ins for what the CPU lacks: the local tiny model (no hub download, no chat template), one CPU."""
    return [
        f"--model.model_name_or_path={tiny_model_dir}",
        "--model.chat_template=false",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--trainer.default_root_dir={tmp_path}",
    ]


def _preset_cli(stage, tiny_model_dir, tmp_path, *extra):
    args = ["--config", str(PRESETS[stage]), *_cpu_overrides(tiny_model_dir, tmp_path), *extra]
    return ExGRPOCLI(ExGRPOModule, PromptDataModule, run=False, args=args)


@pytest.mark.parametrize("stage", [2, 3])
def test_preset_states_the_paper_recipe_for_8_gpus(stage):
    config = yaml.safe_load(PRESETS[stage].read_text())
    trainer, model, data = config["trainer"], config["model"], config["data"]
    assert trainer["accelerator"] == "gpu" and trainer["devices"] == 8
    assert trainer["strategy"]["class_path"] == "lightning.pytorch.strategies.DeepSpeedStrategy"
    assert trainer["strategy"]["init_args"]["stage"] == stage
    assert trainer["precision"] == "bf16-true"
    assert model["model_name_or_path"] == "Qwen/Qwen2.5-Math-1.5B"
    assert model["chat_template"] is True and model["gradient_checkpointing"] is True
    assert (model["max_prompt_length"], model["max_completion_length"]) == (1024, 3072)
    assert data["prompt_column"] == "problem" and data["answer_column"] == "answer"
    assert data["train_path"].startswith("data/")


@pytest.mark.parametrize("stage", [2, 3])
def test_preset_builds_its_deepspeed_strategy(stage, tiny_model_dir, tmp_path):
    cli = _preset_cli(stage, tiny_model_dir, tmp_path)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DeepSpeedStrategy)
    assert strategy.config["zero_optimization"]["stage"] == stage == zero_stage(cli.trainer)
    assert cli.trainer.precision == "bf16-true"
    hp = cli.model.hparams
    assert (hp.num_generations, hp.learning_rate, hp.temperature, hp.beta) == (8, 1e-6, 1.0, 0.0)
    # The official code's loss, entropy weight and updates (configs/exgrpo_paper.yaml's settings).
    assert (hp.loss_type, hp.entropy_coef, hp.scale_rewards) == ("dr_grpo", 0.001 / 24, "none")
    assert hp.entropy_token_budget == 32768
    assert hp.shaping_beta == 0.1
    assert (hp.steps_per_generation, hp.clip_after_replay_starts) == (2, False)
    assert (hp.dtype, hp.attn_implementation, hp.gradient_checkpointing) == ("bfloat16", "sdpa", True)
    assert [type(f).__name__ for f in cli.model.collector.reward_funcs] == ["MathVerifyReward"]
    replay = next(c for c in cli.trainer.callbacks if isinstance(c, ReplayCallback))
    assert (replay.mode, replay.mix_fraction, replay.start_pass_rate) == ("mix", 0.5, 0.35)
    assert replay.buffer.keep == "correct_of_partial" and replay.buffer.bucketer.window_size == 8
    assert replay.replay.strategy == "gaussian_lowest_entropy"
    assert cli.datamodule.hparams.batch_size == 16

    check_strategy(cli.trainer, cli.model, cli.datamodule)
    # The engine clips (Lightning's DeepSpeed plugin ignores clip_gradients), with model.max_grad_norm.
    assert strategy.config["gradient_clipping"] == hp.max_grad_norm == 1 / 24
    # 16 backwards per update are summed, in fp32 (test_deepspeed_sums_every_micro_batch_in_fp32).
    assert strategy.config["managed_gradient_accumulation"] is False
    assert strategy.config["data_types"] == {"grad_accum_dtype": "fp32"}
    check_strategy(cli.trainer, cli.model, cli.datamodule)  # idempotent
    assert needs_synced_generation(cli.trainer) is (stage == 3)


def test_the_module_checks_the_strategy_in_setup(tiny_model_dir, tmp_path):
    # Lightning refuses DeepSpeed on a CPU when fit starts, so call the hook that fit calls on a GPU (before
    # the DeepSpeed engine is built) directly.
    cli = _preset_cli(2, tiny_model_dir, tmp_path, "--model.dtype=float16")
    cli.model.trainer = cli.trainer
    with pytest.raises(ValueError, match=r"model.dtype='float16' but trainer.precision='bf16-true'"):
        cli.model.setup("fit")


def _module(tiny_model_dir, **kwargs):
    kwargs.setdefault("dtype", "bfloat16")
    return ExGRPOModule(model_name_or_path=tiny_model_dir, num_generations=2, **kwargs)


def _trainer(tmp_path, strategy=None, precision="bf16-true", **kwargs):
    return Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy if strategy is not None else DeepSpeedStrategy(stage=2),
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


def _check(tiny_model_dir, tmp_path, config=None, module_kwargs=None, batch_size=16, **trainer_kwargs):
    strategy = trainer_kwargs.pop("strategy", None)
    if config is not None:
        strategy = DeepSpeedStrategy(config=deepcopy(config))  # Lightning and the check write into it
    trainer = _trainer(tmp_path, strategy=strategy, **trainer_kwargs)
    check_strategy(
        trainer, _module(tiny_model_dir, **(module_kwargs or {})), PromptDataModule(batch_size=batch_size)
    )
    return trainer


ZERO2 = {"zero_optimization": {"stage": 2}}


@pytest.mark.parametrize(
    ("config", "module_kwargs", "trainer_kwargs", "message"),
    [
        ({**ZERO2, "gradient_clipping": 0.5}, {}, {}, r"gradient_clipping=0.5 but model.max_grad_norm=1.0"),
        ({**ZERO2, "fp16": {"enabled": True}}, {}, {}, r"enables fp16 but trainer.precision='bf16-true'"),
        ({**ZERO2, "bf16": {"enabled": False}}, {}, {}, r"disables bf16 but trainer.precision='bf16-true'"),
        (
            {**ZERO2, "bf16": {"enabled": True}},
            {"dtype": "float32"},
            {"precision": "32-true"},
            r"enables bf16",
        ),
        (ZERO2, {"dtype": "bfloat16"}, {"precision": "32-true"}, r"without fp32 master weights"),
        (ZERO2, {"dtype": "float16"}, {}, r"model.dtype='float16' but trainer.precision='bf16-true'"),
        ({**ZERO2, "gradient_accumulation_steps": 4}, {}, {}, r"gradient_accumulation_steps=4.*always 1"),
        (
            {**ZERO2, "train_micro_batch_size_per_gpu": 4},
            {},
            {},
            r"train_micro_batch_size_per_gpu=4 but data",
        ),
        ({**ZERO2, "train_batch_size": 64}, {}, {}, r"train_batch_size=64 but data.batch_size=16 x 1"),
        (
            {**ZERO2, "gradient_clipping": "auto", "bf16": {"enabled": "auto"}},
            {},
            {},
            r"'auto' values at gradient_clipping, bf16.enabled",
        ),
        ({"zero_optimization": {"stage": 3}}, {"beta": 0.04}, {}, r"ZeRO stage 3 with model.beta=0.04"),
        ({"zero_optimization": {"stage": 4}}, {}, {}, r"zero_optimization.stage=4: must be 0, 1, 2 or 3"),
        ({**ZERO2, "optimizer": {"type": "AdamW"}}, {}, {}, r"'optimizer' section.*model.learning_rate"),
        ({**ZERO2, "scheduler": {"type": "WarmupLR"}}, {}, {}, r"'scheduler' section"),
        (
            {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
            {},
            {},
            r'offload to cpu.*"zero_force_ds_cpu_optimizer": false',
        ),
        (ZERO2, {}, {"gradient_clip_val": 0.5}, r"gradient_clip_val=0.5.*set model.max_grad_norm: 0.5"),
        (
            ZERO2,
            {},
            {"accumulate_grad_batches": 2},
            r"accumulate_grad_batches=2.*one optimizer step per batch",
        ),
    ],
)
def test_conflicting_deepspeed_config_is_rejected(
    config, module_kwargs, trainer_kwargs, message, tiny_model_dir, tmp_path
):
    with pytest.raises(ValueError, match=message):
        _check(tiny_model_dir, tmp_path, config, module_kwargs, **trainer_kwargs)


def test_every_conflict_is_listed_at_once(tiny_model_dir, tmp_path):
    config = {**ZERO2, "gradient_clipping": 2.0, "fp16": {"enabled": True}}
    with pytest.raises(ValueError) as err:
        _check(tiny_model_dir, tmp_path, config)
    assert "gradient_clipping=2.0" in str(err.value) and "enables fp16" in str(err.value)


@pytest.mark.parametrize(
    "config",
    [
        ZERO2,
        {**ZERO2, "gradient_clipping": 1.0, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 16},
        {**ZERO2, "train_batch_size": 16, "fp16": {"enabled": False}},
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
            "zero_force_ds_cpu_optimizer": False,
        },
    ],
    ids=["plain", "agreeing", "fp16-off", "offload"],
)
def test_agreeing_deepspeed_config_passes(config, tiny_model_dir, tmp_path):
    trainer = _check(tiny_model_dir, tmp_path, config, module_kwargs={"gradient_checkpointing": True})
    assert trainer.strategy.config["gradient_clipping"] == 1.0


def test_skip_grad_norm_is_refused_under_deepspeed(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="model.skip_grad_norm=500.0: the DeepSpeed engine measures"):
        _check(tiny_model_dir, tmp_path, module_kwargs={"skip_grad_norm": 500.0})


def test_offload_parameters_pass_through(tiny_model_dir, tmp_path):
    strategy = DeepSpeedStrategy(stage=3, offload_parameters=True)
    trainer = _check(tiny_model_dir, tmp_path, strategy=strategy)
    assert trainer.strategy.config["zero_optimization"]["offload_param"]["device"] == "cpu"


def test_max_grad_norm_zero_turns_engine_clipping_off(tiny_model_dir, tmp_path):
    trainer = _check(tiny_model_dir, tmp_path, ZERO2, module_kwargs={"max_grad_norm": 0.0})
    assert trainer.strategy.config["gradient_clipping"] == 0.0


@pytest.mark.parametrize(
    ("config", "precision", "expected"),
    [
        (ZERO2, "bf16-true", {"grad_accum_dtype": "fp32"}),
        ({**ZERO2, "data_types": {"grad_accum_dtype": "bf16"}}, "bf16-true", {"grad_accum_dtype": "bf16"}),
        ({"zero_optimization": {"stage": 0}}, "bf16-true", None),  # DeepSpeed: "unsupported mix" there
        (ZERO2, "32-true", None),
    ],
    ids=["bf16-zero2", "user-choice-kept", "bf16-no-zero", "fp32"],
)
def test_bf16_gradients_accumulate_in_fp32_unless_the_config_says(
    config, precision, expected, tiny_model_dir, tmp_path
):
    module_kwargs = {"dtype": "float32" if precision == "32-true" else "bfloat16"}
    trainer = _check(tiny_model_dir, tmp_path, config, module_kwargs, precision=precision)
    assert trainer.strategy.config.get("data_types") == expected
    assert trainer.strategy.config["managed_gradient_accumulation"] is False


def test_zero1_gives_up_overlap_comm_for_unmanaged_accumulation(tiny_model_dir, tmp_path):
    trainer = _check(tiny_model_dir, tmp_path, strategy=DeepSpeedStrategy(stage=1))
    assert trainer.strategy.config["zero_optimization"]["overlap_comm"] is False


def test_a_deepspeed_without_unmanaged_accumulation_is_rejected(tiny_model_dir, tmp_path, monkeypatch):
    from deepspeed.runtime import constants

    monkeypatch.delattr(constants, "MANAGED_GRADIENT_ACCUMULATION")
    with pytest.raises(ValueError, match="no managed_gradient_accumulation setting"):
        _check(tiny_model_dir, tmp_path, ZERO2)


def test_a_small_step_vanishes_on_bf16_weights_and_not_on_fp32_ones():
    """Why 16-bit weights need fp32 master weights: AdamW's first step moves each weight by ~lr."""
    moved = {}
    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        optimizer = torch.optim.AdamW([weight], lr=1e-6, weight_decay=0.0)
        weight.grad = torch.full_like(weight, 0.5)
        optimizer.step()
        moved[dtype] = bool((weight != 1).all())
    assert moved == {torch.bfloat16: False, torch.float32: True}


@pytest.mark.parametrize(
    ("strategy", "precision", "module_kwargs", "message"),
    [
        ("auto", "32-true", {"dtype": "bfloat16"}, r"model.dtype='bfloat16' with SingleDeviceStrategy"),
        ("auto", "bf16-mixed", {"dtype": "bfloat16"}, r"model.dtype='bfloat16'.*no fp32 master copy"),
        ("ddp", "16-mixed", {"dtype": "float16"}, r"model.dtype='float16' with DDPStrategy"),
        ("ddp", "bf16-true", {"dtype": "float32"}, r"trainer.precision='bf16-true' with DDPStrategy"),
        ("auto", "16-true", {"dtype": "float32"}, r"precision='16-true'.*use trainer.precision: bf16-mixed"),
        (
            "auto",
            "bf16-true",
            {"dtype": "bfloat16", "lora": {"r": 2}},  # bf16-true converts the adapter too
            r"trainer.precision='bf16-true'",
        ),
    ],
)
def test_training_16_bit_weights_without_deepspeed_is_rejected(
    strategy, precision, module_kwargs, message, tiny_model_dir, tmp_path
):
    with pytest.raises(ValueError, match=message) as err:
        _check(tiny_model_dir, tmp_path, strategy=strategy, precision=precision, module_kwargs=module_kwargs)
    assert "DeepSpeed" in str(err.value)


@pytest.mark.parametrize(
    ("precision", "module_kwargs"),
    [
        ("bf16-mixed", {"dtype": "float32"}),
        ("16-mixed", {"dtype": "float32"}),
        ("32-true", {"dtype": "float32"}),
        ("bf16-mixed", {"dtype": "bfloat16", "lora": {"r": 2}}),  # test_lora_adapter_of_a_bf16_base_is_fp32
    ],
)
def test_fp32_weights_without_deepspeed_pass(precision, module_kwargs, tiny_model_dir, tmp_path):
    _check(tiny_model_dir, tmp_path, strategy="auto", precision=precision, module_kwargs=module_kwargs)


def test_evaluating_16_bit_weights_without_deepspeed_passes(tiny_model_dir, tmp_path):
    trainer = _trainer(tmp_path, "auto")
    trainer.state.fn = TrainerFn.VALIDATING  # as Trainer.validate sets it before the module's setup
    check_strategy(trainer, _module(tiny_model_dir), None)


def test_lora_adapter_of_a_bf16_base_is_fp32(tiny_model_dir):
    pytest.importorskip("peft")
    module = _module(tiny_model_dir, lora={"r": 2, "target_modules": "all-linear"})
    module.configure_model()
    trained = {p.dtype for p in module.policy.parameters() if p.requires_grad}
    frozen = {p.dtype for p in module.policy.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}


def test_without_deepspeed_the_trainer_and_the_weights_dtype_are_checked(tiny_model_dir, tmp_path):
    fp32 = {"dtype": "float32"}
    trainer = _check(tiny_model_dir, tmp_path, strategy="auto", precision="32-true", module_kwargs=fp32)
    assert zero_stage(trainer) is None and needs_synced_generation(trainer) is False
    with pytest.raises(ValueError, match="gradient_clip_val"):
        _check(
            tiny_model_dir,
            tmp_path,
            strategy="auto",
            precision="32-true",
            module_kwargs=fp32,
            gradient_clip_val=1.0,
        )


@pytest.mark.parametrize(("stage", "synced"), [(0, False), (1, False), (2, False), (3, True)])
def test_synced_generation_only_under_zero3(stage, synced, tmp_path):
    assert needs_synced_generation(_trainer(tmp_path, DeepSpeedStrategy(stage=stage))) is synced


def test_hf_deepspeed_config_only_under_zero3(tmp_path):
    from transformers.integrations import is_deepspeed_zero3_enabled

    assert hf_deepspeed_config(_trainer(tmp_path, DeepSpeedStrategy(stage=2))) is None
    assert hf_deepspeed_config(_trainer(tmp_path, "auto", precision="32-true")) is None
    config = hf_deepspeed_config(_trainer(tmp_path, DeepSpeedStrategy(stage=3)))
    assert config.is_zero3() and is_deepspeed_zero3_enabled()
    del config  # transformers holds a weak reference: ZeRO-3 awareness lasts as long as the object
    assert not is_deepspeed_zero3_enabled()


# Loads a checkpoint inside deepspeed.zero.Init (what Lightning wraps configure_model in under ZeRO-3), on
# the CPU with a one-process gloo group, without and with hf_deepspeed_config alive.
_ZERO3_LOAD = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy
from transformers import AutoModelForCausalLM
from exgrpo_pl.module.strategies import hf_deepspeed_config
deepspeed.init_distributed(dist_backend="gloo")
path, name = sys.argv[1], "model.layers.0.mlp.up_proj.weight"
expected = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())[name].detach()
trainer = Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=3), logger=False)
config = trainer.strategy.config
config["train_micro_batch_size_per_gpu"] = 1  # as Lightning's setup sets it before configure_model
def load():
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = AutoModelForCausalLM.from_pretrained(path)
    param = dict(model.named_parameters())[name]
    with deepspeed.zero.GatheredParameters([param]):
        return torch.equal(param.detach(), expected)
try:
    print("plain", load())
except Exception as err:
    print("plain", type(err).__name__)
keep = hf_deepspeed_config(trainer)
print("hf", load())
"""


@pytest.mark.slow
def test_zero3_loading_needs_hf_deepspeed_config(tiny_model_dir):
    port = str(29500 + __import__("os").getpid() % 1000)
    result = subprocess.run(
        [sys.executable, "-c", _ZERO3_LOAD, tiny_model_dir, port], capture_output=True, text=True, timeout=600
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(("plain", "hf"))]
    assert result.returncode == 0, result.stderr[-2000:]
    assert lines[0] != "plain True"  # zero.Init alone cannot load a checkpoint
    assert lines[1] == "hf True"


# One DeepSpeed step of three backwards (x = 1, 1/2, 1/4 through w = 1: gradients 1, 1/2, 1/4), SGD with lr 1,
# as ExGRPOModule steps: several engine.backward, then one engine.step. With check_strategy's config the step
# applies their sum (w = 1 - 1.75); with Lightning's bare config only the last one (w = 1 - 0.25).
_ACCUMULATE = """
import os, sys, torch
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import deepspeed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.module.strategies import check_strategy
deepspeed.init_distributed(dist_backend="gloo")
for stage in (1, 2, 3):
    for checked in (True, False):
        trainer = Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(stage=stage),
                          precision="bf16-true", logger=False)
        module = ExGRPOModule(model_name_or_path=sys.argv[1], num_generations=2, dtype="bfloat16")
        if checked:
            check_strategy(trainer, module, PromptDataModule(batch_size=1))
        trainer.strategy._init_config_if_needed()  # Lightning's setup adds the bf16 section
        config = {**trainer.strategy.config, "gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 1}
        layer = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(layer.weight)
        engine, *_ = deepspeed.initialize(
            model=layer, optimizer=torch.optim.SGD(layer.parameters(), lr=1.0), config=config
        )
        for x in (1.0, 0.5, 0.25):
            engine.backward(engine(torch.tensor([[x]], dtype=torch.bfloat16)).sum())
        engine.step()
        weight = next(engine.module.parameters())
        with deepspeed.zero.GatheredParameters([weight], enabled=stage == 3):
            value = weight.item()
        print("RESULT", stage, checked, value, str(engine.get_data_types()[1]), flush=True)
"""


@pytest.mark.slow
def test_deepspeed_sums_every_micro_batch_in_fp32(tiny_model_dir):
    port = str(29500 + __import__("os").getpid() % 1000)
    result = subprocess.run(
        [sys.executable, "-c", _ACCUMULATE, tiny_model_dir, port], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("RESULT")]
    weights = {(int(stage), checked == "True"): float(value) for stage, checked, value, _ in rows}
    accumulation = {(int(stage), checked == "True"): dtype for stage, checked, _, dtype in rows}
    for stage in (1, 2, 3):
        assert weights[stage, True] == 1 - 1.75 and accumulation[stage, True] == "torch.float32"
    # The trap: Lightning's own config keeps only the last micro-batch's gradient under ZeRO 1-2.
    assert weights[1, False] == weights[2, False] == 1 - 0.25

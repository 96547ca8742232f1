"""Strategy checks: catch a DeepSpeed config that conflicts with the trainer or the module before training.

Lightning's `DeepSpeedStrategy` builds a DeepSpeed config from its arguments, or takes the user's `config`
(dict or JSON file), and fills in `gradient_accumulation_steps`, `train_micro_batch_size_per_gpu`,
`gradient_clipping` and the `fp16`/`bf16` sections from the trainer only at setup, after the model is
built. A user config that disagrees with the trainer then fails late (after a multi-GB model load), or
worse, trains silently with settings nobody asked for. `check_strategy` says so before anything is loaded;
`ExGRPOModule.setup` calls it before fit, validate and test.

    from exgrpo_pl.module.strategies import check_strategy
    check_strategy(trainer, module, datamodule)   # raises ValueError naming every conflict

Two helpers for the module under sharding: `needs_synced_generation(trainer)` (pass it as `synced_gpus` to
generation) and `hf_deepspeed_config(trainer)` (create it before `from_pretrained` under ZeRO-3, keep it).

Gradient clipping under DeepSpeed: `ExGRPOModule` optimizes manually and clips with `model.max_grad_norm`
through `LightningModule.clip_gradients`, which Lightning's DeepSpeed precision plugin turns into a no-op
(DeepSpeed clips inside `engine.step()` with the config's `gradient_clipping`). So `check_strategy` writes
`model.max_grad_norm` into the config's `gradient_clipping` when the config has none, and rejects a config
whose `gradient_clipping` differs from it: `model.max_grad_norm` stays the one setting to change.

Gradient accumulation under DeepSpeed: a step sums the gradients of every micro-batch (128 rollouts in
micro-batches of 4 are 32 `engine.backward` calls, then one `engine.step()`), while Lightning sets DeepSpeed's
`gradient_accumulation_steps` to 1, so DeepSpeed takes every backward for an accumulation boundary; under
ZeRO 1-2 each one then overwrites the last (DeepSpeed 0.19.8, measured on the CPU: the step applies the last
micro-batch's gradient only) unless the config says `managed_gradient_accumulation: false` (the caller owns
the boundary: `step()`), which `check_strategy` sets (at stage 1 with `overlap_comm: false`, which DeepSpeed
requires there). Under ZeRO-3 a backward adds to the step's gradient only once the engine has counted a
micro-step, which it does at the start of each engine forward, while the module runs all its micro-batches
inside the one forward Lightning wraps around `training_step`: the update counts them itself
(`PolicyUpdate._count_micro_step`; `scripts/gpu_multi.py --checks zero3`). And DeepSpeed sums in the model's
dtype unless
`data_types.grad_accum_dtype` says otherwise; in bf16 (8 significant bits) small contributions round away.
Under ZeRO stages 1-3 (DeepSpeed accumulates bf16 gradients in fp32 only there) `check_strategy` sets
`grad_accum_dtype: fp32`. Either key given in the config is kept.

Master weights: outside DeepSpeed nothing keeps an fp32 copy of 16-bit weights, so an AdamW step of 1e-6 on
a bf16 weight of size ~1 (spacing 2**-7) rounds to nothing and the model never moves. `check_strategy`
rejects training with bf16/fp16 weights (`model.dtype`, or `trainer.precision` `bf16-true` / `16-true`,
which convert the weights) under any other strategy; `bf16-mixed` with float32 weights is the way there.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from exgrpo_pl.lightning_internals import deepspeed_config_filled_in

# Trainer precision flag -> the DeepSpeed section that Lightning enables for it (None: neither).
_PRECISION_SECTION = {
    "16-mixed": "fp16",
    "16-true": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
}
# The module's parameter dtype -> the DeepSpeed section it goes with.
_DTYPE_SECTION = {"float16": "fp16", "bfloat16": "bf16", "float32": None}
# Trainer precision flags under which Lightning converts the weights themselves to 16 bits.
_HALF_WEIGHT_PRECISIONS = ("bf16-true", "16-true")


def deepspeed_config(trainer: Trainer) -> dict[str, Any] | None:
    """The DeepSpeed config of `trainer`'s strategy (as the user gave it until setup), or None."""
    strategy = trainer.strategy
    if not isinstance(strategy, DeepSpeedStrategy):
        return None
    return strategy.config if isinstance(strategy.config, dict) else None


def zero_stage(trainer: Trainer) -> int | None:
    """The ZeRO stage of a DeepSpeed trainer (0 when ZeRO is off), or None for any other strategy."""
    config = deepspeed_config(trainer)
    if config is None:
        return None
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return 0
    return int(zero.get("stage", 0))


def needs_synced_generation(trainer: Trainer) -> bool:
    """Whether every rank must keep calling forward while any rank still generates (`synced_gpus=True`).

    True under DeepSpeed ZeRO stage 3 and under FSDP, where each forward gathers parameter shards from all
    ranks: a rank that stops generating early would leave the others waiting forever. transformers
    detects ZeRO-3 itself only through its own `HfDeepSpeedConfig`, which Lightning does not create, so
    the module has to pass `synced_gpus` explicitly.
    """
    if isinstance(trainer.strategy, FSDPStrategy):
        return True
    return zero_stage(trainer) == 3


def hf_deepspeed_config(trainer: Trainer) -> Any | None:
    """transformers' `HfDeepSpeedConfig` for a ZeRO-3 trainer's config; None for anything else.

    Under ZeRO-3, Lightning builds the model inside `deepspeed.zero.Init`, which partitions every parameter
    as it is created; `from_pretrained` then writes the checkpoint into empty partitions and fails
    (`IndexError: index 0 is out of bounds for dimension 0 with size 0`) unless transformers knows ZeRO-3
    is on, which it learns only from a live `HfDeepSpeedConfig` (it keeps a weak reference). Create it in
    `configure_model` (Lightning has completed the config by then: precision, clipping) before loading
    the policy, and keep the returned object as long as the model lives; transformers' `generate` then
    also turns on `synced_gpus` by itself when there is more than one rank.
    """
    if zero_stage(trainer) != 3:
        return None
    from transformers.integrations import HfDeepSpeedConfig

    # transformers opens its own zero.Init with this config, and DeepSpeed rejects a config without a batch
    # size; Lightning sets it at setup, so a config read earlier gets a placeholder (irrelevant to init).
    config = {"train_micro_batch_size_per_gpu": 1, **trainer.strategy.config}
    return HfDeepSpeedConfig(config)


def check_strategy(
    trainer: Trainer, module: LightningModule, datamodule: LightningDataModule | None = None
) -> None:
    """Raise ValueError, before training, if the trainer's strategy conflicts with the trainer or module.

    Checked for any strategy, when the module optimizes manually (`ExGRPOModule` does):
    `trainer.gradient_clip_val` (use `model.max_grad_norm`) and `trainer.accumulate_grad_batches != 1`.

    Checked under `DeepSpeedStrategy`, on the config as given (Lightning fills in the rest at setup):

    - `"auto"` values (transformers' Trainer resolves them; Lightning and DeepSpeed do not);
    - `gradient_accumulation_steps` (Lightning sets it from the trainer; here it is always 1);
    - `train_micro_batch_size_per_gpu` / `train_batch_size` that disagree with the data's batch size;
    - `gradient_clipping` that differs from `model.max_grad_norm` (absent: filled in from it);
    - `fp16` / `bf16` sections that disagree with `trainer.precision`, and `model.dtype` that does;
    - sets `managed_gradient_accumulation: false` and, under bf16 with ZeRO, `data_types.grad_accum_dtype:
      fp32`, unless the config sets them; an installed DeepSpeed without `managed_gradient_accumulation`;
    - a ZeRO stage outside 0-3; ZeRO-3 with `model.beta > 0` (the frozen reference is a deep copy of the
      partitioned policy, which ZeRO-3 cannot run);
    - optimizer offload with the module's `torch.optim.AdamW` while DeepSpeed insists on its CPU Adam;
    - `optimizer` / `scheduler` sections (the module builds its own from `model.learning_rate`).

    ZeRO-3 with `model.gradient_checkpointing` is fine; other offload settings are passed through.

    Checked under any other strategy, when fitting: no 16-bit weights to train (`model.dtype` bfloat16 or
    float16 without `model.lora`, `trainer.precision` bf16-true or 16-true), since only DeepSpeed keeps fp32
    master weights.

    Args:
        trainer: the trainer, constructed but not yet fitting.
        module: the LightningModule to train (its `hparams` supply `max_grad_norm`, `dtype`, `beta`).
        datamodule: the datamodule, for its `batch_size`; defaults to `trainer.datamodule`.

    Raises:
        ValueError: listing every conflict found, each with the setting to change.
    """
    problems: list[str] = []
    manual = not module.automatic_optimization
    hparams = getattr(module, "hparams", {}) or {}
    max_grad_norm = hparams.get("max_grad_norm")
    if manual and trainer.gradient_clip_val:
        fix = f"set model.max_grad_norm: {trainer.gradient_clip_val}" if max_grad_norm is not None else ""
        problems.append(
            f"trainer.gradient_clip_val={trainer.gradient_clip_val}: {type(module).__name__} optimizes "
            f"manually and clips its own gradients; remove trainer.gradient_clip_val"
            + (f" and {fix}" if fix else "")
        )
    if manual and trainer.accumulate_grad_batches != 1:
        problems.append(
            f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches}: {type(module).__name__} "
            "optimizes manually, one optimizer step per batch; remove it (model.micro_batch_size bounds "
            "memory, data.batch_size sets the batch)"
        )
    config = deepspeed_config(trainer)
    if config is not None:
        problems += _deepspeed_problems(trainer, module, datamodule, config, hparams)
    elif trainer.state.fn not in (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING):
        problems += _master_weight_problems(trainer, hparams)
    if problems:
        raise ValueError("conflicting trainer / strategy / model settings:\n  - " + "\n  - ".join(problems))
    if config is not None and manual and max_grad_norm is not None and "gradient_clipping" not in config:
        # DeepSpeed's precision plugin ignores LightningModule.clip_gradients: the engine must clip.
        config["gradient_clipping"] = float(max_grad_norm)
    if config is not None:
        config.setdefault("managed_gradient_accumulation", False)  # several backwards, one step()
        if config["managed_gradient_accumulation"] is False and zero_stage(trainer) == 1:
            config["zero_optimization"]["overlap_comm"] = False  # DeepSpeed refuses both together at stage 1
        if _PRECISION_SECTION.get(str(trainer.precision)) == "bf16" and zero_stage(trainer):
            config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")


def _master_weight_problems(trainer: Trainer, hparams: Any) -> list[str]:
    """Training 16-bit weights without DeepSpeed, which alone keeps fp32 master weights for them.

    With `model.lora`, peft keeps the trained adapter in float32 over the frozen 16-bit base (its
    `autocast_adapter_dtype`), so only a precision flag that converts every weight is a problem there.
    """
    problems = []
    strategy = type(trainer.strategy).__name__
    precision = str(trainer.precision)
    fix = (
        "use trainer.precision: bf16-mixed with model.dtype: float32 (fp32 weights, bf16 compute), or a "
        "DeepSpeed strategy, which keeps fp32 master weights (configs/qwen2.5-math-1.5b_zero2.yaml)"
    )
    if precision in _HALF_WEIGHT_PRECISIONS:
        problems.append(
            f"trainer.precision={precision!r} with {strategy}: Lightning converts the weights to 16 bits and "
            f"the optimizer updates them with no fp32 master copy (a 1e-6 step rounds away); {fix}"
        )
    dtype = hparams.get("dtype")
    if dtype in ("bfloat16", "float16") and not hparams.get("lora"):
        problems.append(
            f"model.dtype={dtype!r} with {strategy}: the optimizer would update {dtype} weights with no fp32 "
            f"master copy (a 1e-6 step rounds away); {fix}"
        )
    return problems


def _deepspeed_problems(
    trainer: Trainer,
    module: LightningModule,
    datamodule: LightningDataModule | None,
    config: dict[str, Any],
    hparams: Any,
) -> list[str]:
    problems: list[str] = []
    if not _deepspeed_knows_unmanaged_accumulation():
        import deepspeed

        problems.append(
            f"deepspeed {deepspeed.__version__} has no managed_gradient_accumulation setting: under ZeRO 1-2 "
            "it would apply only the last micro-batch's gradient of each step; install deepspeed>=0.19.5 "
            "(0.19.4 added it, 0.19.5 with optimizer offload)"
        )
    if hparams.get("skip_grad_norm") is not None:
        problems.append(
            f"model.skip_grad_norm={hparams.get('skip_grad_norm')}: the DeepSpeed engine measures the "
            "gradient norm inside its step, after which the update cannot be withheld; remove it (or use DDP)"
        )
    formatted = deepspeed_config_filled_in(trainer.strategy)  # Lightning has filled it in
    auto = _auto_keys(config)
    if auto:
        problems.append(
            f"DeepSpeed config has 'auto' values at {', '.join(auto)}: only transformers' Trainer resolves "
            "'auto'; remove these keys (Lightning fills batch size, accumulation, clipping and precision "
            "from the trainer and model) or give numbers"
        )

    # Batch size and accumulation.
    gas = config.get("gradient_accumulation_steps")
    if gas is not None and (not formatted or gas != 1):
        problems.append(
            f"DeepSpeed config sets gradient_accumulation_steps={gas}: Lightning sets it from "
            "trainer.accumulate_grad_batches, and the module takes one optimizer step per batch (it is "
            "always 1); remove it (model.micro_batch_size bounds memory)"
        )
    batch_size = _batch_size(datamodule if datamodule is not None else trainer.datamodule)
    micro = config.get("train_micro_batch_size_per_gpu")
    if batch_size is not None and isinstance(micro, int) and micro != batch_size:
        problems.append(
            f"DeepSpeed config sets train_micro_batch_size_per_gpu={micro} but data.batch_size={batch_size} "
            "prompts per GPU per step; remove it (Lightning takes it from the dataloader) or make them equal"
        )
    world = trainer.num_devices * trainer.num_nodes
    total = config.get("train_batch_size")
    if batch_size is not None and isinstance(total, int) and total != batch_size * world:
        problems.append(
            f"DeepSpeed config sets train_batch_size={total} but data.batch_size={batch_size} x "
            f"{world} GPU(s) = {batch_size * world} prompts per step; remove train_batch_size"
        )

    # Gradient clipping: the engine clips, with model.max_grad_norm.
    max_grad_norm = hparams.get("max_grad_norm")
    clipping = config.get("gradient_clipping")
    if (
        not module.automatic_optimization
        and max_grad_norm is not None
        and isinstance(clipping, (int, float))
        and float(clipping) != float(max_grad_norm)
    ):
        problems.append(
            f"DeepSpeed config sets gradient_clipping={clipping} but model.max_grad_norm={max_grad_norm}: "
            "gradients are clipped once, by the DeepSpeed engine, with model.max_grad_norm; remove "
            "gradient_clipping from the DeepSpeed config and set model.max_grad_norm"
        )

    # Precision.
    precision = str(trainer.precision)
    wanted = _PRECISION_SECTION.get(precision)
    for key in ("fp16", "bf16", "bfloat16"):
        section = config.get(key)
        if not isinstance(section, dict):
            continue
        name = "bf16" if key == "bfloat16" else key
        enabled = section.get("enabled", False)
        if enabled is True and name != wanted:
            problems.append(
                f"DeepSpeed config enables {key} but trainer.precision={precision!r}; Lightning sets the "
                f"fp16/bf16 section from trainer.precision: remove '{key}' from the DeepSpeed config or set "
                f"trainer.precision to {'16-mixed' if name == 'fp16' else 'bf16-true'}"
            )
        elif enabled is False and name == wanted:
            problems.append(
                f"DeepSpeed config disables {key} but trainer.precision={precision!r}; Lightning leaves a "
                f"given '{key}' section alone, so DeepSpeed would train in fp32: remove '{key}' from the "
                "DeepSpeed config"
            )
    dtype = hparams.get("dtype")
    if dtype in _DTYPE_SECTION and _DTYPE_SECTION[dtype] != wanted:
        if wanted is None:
            problems.append(
                f"model.dtype={dtype!r} with trainer.precision={precision!r}: DeepSpeed would update "
                f"{dtype} weights without fp32 master weights (a 1e-6 step vanishes in bf16); set "
                "trainer.precision: bf16-true (DeepSpeed keeps fp32 master weights) or model.dtype: float32"
            )
        elif dtype != "float32":
            problems.append(
                f"model.dtype={dtype!r} but trainer.precision={precision!r}: make them agree (bfloat16 with "
                "bf16-true/bf16-mixed, float16 with 16-mixed)"
            )

    # ZeRO.
    zero = config.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, 1, 2, 3):
        problems.append(f"DeepSpeed zero_optimization.stage={stage!r}: must be 0, 1, 2 or 3")
    beta = hparams.get("beta")
    if stage == 3 and beta:
        problems.append(
            f"ZeRO stage 3 with model.beta={beta}: the KL reference is a deep copy of the policy, whose "
            "parameters ZeRO-3 partitions and only the engine can gather; use stage 2 or model.beta: 0"
        )
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    device = offload.get("device") if isinstance(offload, dict) else None
    forced = config.get("zero_force_ds_cpu_optimizer", True)
    if device in ("cpu", "nvme") and forced and "optimizer" not in config:
        problems.append(
            f"optimizer offload to {device} with the module's torch.optim.AdamW: DeepSpeed refuses it unless "
            'the config says "zero_force_ds_cpu_optimizer": false (the optimizer step then runs in torch on '
            "the CPU, slowly); pass a DeepSpeed config with that key, or do not offload the optimizer"
        )
    for key in ("optimizer", "scheduler"):
        if key in config:
            problems.append(
                f"DeepSpeed config has an '{key}' section: the module builds its AdamW and learning-rate "
                "schedule from model.learning_rate, model.warmup_steps and model.lr_scheduler_type, and "
                f"steps the schedule itself; remove '{key}' from the DeepSpeed config"
            )
    return problems


def _deepspeed_knows_unmanaged_accumulation() -> bool:
    """Whether the installed DeepSpeed reads `managed_gradient_accumulation` from its config."""
    from deepspeed.runtime import constants

    return hasattr(constants, "MANAGED_GRADIENT_ACCUMULATION")


def _auto_keys(config: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every value that is the string "auto"."""
    if isinstance(config, dict):
        return [path for key, value in config.items() for path in _auto_keys(value, f"{prefix}{key}.")]
    if isinstance(config, str) and config.strip().lower() == "auto":
        return [prefix.rstrip(".")]
    return []


def _batch_size(datamodule: Any) -> int | None:
    """Prompts per training batch per GPU, when the datamodule says."""
    if datamodule is None:
        return None
    hparams = getattr(datamodule, "hparams", None)
    value = hparams.get("batch_size") if hparams else None
    if value is None:
        value = getattr(datamodule, "batch_size", None)
    return value if isinstance(value, int) else None

"""Both engines as the module runs them: in train mode with gradient checkpointing on, and through
`Trainer.fit`, whose validation runs under `torch.inference_mode`."""

import logging

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer
from torch.nn.utils.rnn import pad_sequence
from torchmetrics import MeanMetric

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.engines import StaticCacheEngine

ENGINES = {"hf": None, "static": {"compile": False}}


def generate_recording_forwards(module, ids, mask):
    """Greedy completions, and each forward's input width and train flag as its first layer saw them."""
    widths, modes = [], []

    def record(layer, args, kwargs):
        widths.append((args[0] if args else kwargs["hidden_states"]).shape[1])
        modes.append(layer.training)

    hook = module.policy.model.layers[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        return module.engine.generate(ids, mask, module._sampling(0.0)), widths, modes
    finally:
        hook.remove()


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_completions_do_not_depend_on_gradient_checkpointing(tiny_model_dir, engine):
    """Rollouts are sampled in eval mode from the KV cache (one new token per forward), whatever the policy's
    train/eval mode and checkpointing, which is restored afterwards."""
    completions = []
    for checkpointing in (False, True):
        module = tiny_module(
            tiny_model_dir, rollout_engine=engine, rollout_engine_options=ENGINES[engine],
            gradient_checkpointing=checkpointing, max_completion_length=12,
        )  # fmt: skip
        module.configure_model()
        assert module.policy.training and module.policy.is_gradient_checkpointing == checkpointing
        prompts = module.collector.encode(["12+34=", "5+6="], torch.tensor([0, 1]))
        ids = pad_sequence(prompts, batch_first=True, padding_side="left")
        mask = pad_sequence([p > -1 for p in prompts], batch_first=True, padding_side="left")
        out, widths, modes = generate_recording_forwards(module, ids, mask)
        completions.append(out)
        assert widths[0] == ids.shape[1] and set(widths[1:]) == {1}  # the cache was used
        assert not any(modes)  # every forward ran in eval mode
        assert module.policy.training and module.policy.model.layers[0].training  # and train mode is back
    assert completions[0].ids.shape[1] > 1
    assert torch.equal(completions[0].ids, completions[1].ids)
    assert torch.equal(completions[0].mask, completions[1].mask)


class BucketLog:
    """Wraps an engine: the bucket each call got, its rows, whether it was new, and whether the caller ran
    under `torch.inference_mode`."""

    def __init__(self, engine: StaticCacheEngine) -> None:
        self.calls = []
        self.inference = False
        lookup, generate, warm_up = engine._bucket, engine.generate, engine.warm_up

        def logged(rows, length, device, dtype):
            before = engine.allocations
            bucket = lookup(rows, length, device, dtype)
            new = engine.allocations > before
            if new:
                bucket.serial = engine.allocations  # ids of freed objects are reused; this is not
            self.calls.append((bucket.serial, rows, self.inference, new))
            return bucket

        def noting_mode(method):
            def call(*args):
                self.inference = torch.is_inference_mode_enabled()
                return method(*args)

            return call

        engine._bucket = logged
        engine.generate, engine.warm_up = noting_mode(generate), noting_mode(warm_up)


def run(tmp_path, tiny_model_dir, engine, options, validate_first):
    """Training takes 4 rows (1 prompt x K = 4), validation 8 then 3 (11 prompts in batches of 8), padded to
    8 and 4 rows: validation makes the 4-row bucket that training then fills in place."""
    module = tiny_module(
        tiny_model_dir, rollout_engine=engine, rollout_engine_options={**(ENGINES[engine] or {}), **options}
        or None, max_prompt_length=16,
    )  # fmt: skip
    data = PromptDataModule(
        synthetic=ArithmeticTask(num_questions=110, seed=1), batch_size=1, val_batch_size=8, val_fraction=0.1
    )
    settings = dict(
        default_root_dir=tmp_path, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module.configure_model()
    log = BucketLog(module.engine) if engine == "static" else None
    if validate_first:
        Trainer(**settings).validate(module, datamodule=data)
        # The module's pass@1 metric keeps inference-tensor states from `validate` too, which `fit`'s
        # validation cannot update: a fresh one, so this test sees the engine's buckets only.
        module.val_pass_at_1 = MeanMetric()
    trainer = Trainer(max_steps=4, val_check_interval=2, num_sanity_val_steps=-1, **settings)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 4 and len(data.val_rows) == 11
    return module, log


@pytest.mark.parametrize("engine", list(ENGINES))
def test_validation_during_fit_evicts_and_remakes_the_bucket_training_uses(
    tmp_path, tiny_model_dir, engine, caplog
):
    """One bucket kept (`max_buckets=1`): every change of shape drops a bucket and makes one. Lightning runs
    the validation inside `fit` (sanity check included) under no_grad, not inference mode. The warm-up
    before training is timed in the log."""
    options = {"max_buckets": 1} if engine == "static" else {}
    lightning_log = logging.getLogger("lightning.pytorch")  # it does not propagate to caplog's root handler
    lightning_log.addHandler(caplog.handler)
    try:
        module, log = run(tmp_path, tiny_model_dir, engine, options, validate_first=False)
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert f"rollout engine '{engine}' warmed up in" in caplog.text
    if log is None:
        return
    made_for_4_rows = {bucket for bucket, rows, _, new in log.calls if rows == 4 and new}
    assert len(made_for_4_rows) == 4  # warm-up, sanity check, the validations after steps 2 and 4
    assert sum(not new for _, rows, _, new in log.calls if rows == 4) == 4  # the 4 steps reused them
    assert not any(inference for _, _, inference, _ in log.calls)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_fit_after_validate_fills_buckets_made_under_inference_mode(tmp_path, tiny_model_dir, engine):
    """`trainer.validate` runs under `torch.inference_mode`; a later `fit` of the same module reuses the
    buckets it made (`max_buckets=2` keeps both shapes), in the warm-up, the sanity check and every step."""
    options = {"max_buckets": 2} if engine == "static" else {}
    module, log = run(tmp_path, tiny_model_dir, engine, options, validate_first=True)
    if log is None:
        return
    made_under_inference = {bucket for bucket, _, inference, new in log.calls if inference and new}
    reused = [
        rows for bucket, rows, inference, _ in log.calls if not inference and bucket in made_under_inference
    ]
    assert len(made_under_inference) == 2 and reused.count(4) >= 4
    assert not any(t.is_inference() for bucket in module.engine._buckets.values() for t in bucket._buffers())
    assert not module.engine._arena.is_inference()

"""The update's handling of loss scaling and of steps that DeepSpeed skips (`exgrpo_pl.update`)."""

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_module
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.update import NonFiniteGuard, _clip_gradients


def test_scaled_gradients_are_measured_and_clipped_as_unscaled():
    """Under 16-mixed the gradients are still scaled when the module clips them (Lightning unscales later)."""
    weight = torch.nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([3.0, 4.0]) * 1024  # a norm of 5, scaled by 1024
    scaler = SimpleNamespace(get_scale=lambda: 1024.0)
    module = SimpleNamespace(
        trainer=SimpleNamespace(strategy="ddp", precision_plugin=SimpleNamespace(scaler=scaler)),
        policy=torch.nn.ParameterList([weight]),
        hparams=SimpleNamespace(max_grad_norm=1.0),
        clip_gradients=lambda optimizer, gradient_clip_val, gradient_clip_algorithm: (
            torch.nn.utils.clip_grad_norm_([weight], gradient_clip_val)
        ),
    )
    assert _clip_gradients(module, None) == 5.0
    assert torch.allclose(weight.grad / 1024, torch.tensor([0.6, 0.8]))


def test_a_loss_scaler_overflow_is_counted_but_does_not_stop_the_run():
    guard = NonFiniteGuard(max_in_a_row=2)
    for step in range(3):
        guard.skip(step, loss=0.1, grad_norm=float("inf"), scaler_overflow=True)
    assert (guard.skipped, guard.in_a_row) == (3, 0)
    guard.skip(3, loss=float("nan"), grad_norm=None)
    with pytest.raises(RuntimeError, match="2 updates in a row"):
        guard.skip(4, loss=float("nan"), grad_norm=None)


def test_fp16_loss_scaler_overflows_early_in_a_run_do_not_stop_it(tiny_model_dir, tmp_path):
    # A scale far too large for fp16 activations' gradients: the first steps overflow until it has come down.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-4)
    module = tiny_module(tiny_model_dir, max_nonfinite_steps=2)
    trainer = Trainer(
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=4)
    trainer.fit(module, datamodule=data)
    assert module.nonfinite.skipped >= 2 and scaler.get_scale() < 2.0**24
    assert trainer.global_step == 6

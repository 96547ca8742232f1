"""The update's handling of loss scaling and of steps that DeepSpeed skips (`exgrpo_pl.step.update`)."""

import json
import multiprocessing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CPUDeepSpeedStrategy, tiny_module
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision

from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.step.update import NonFiniteGuard, PolicyUpdate, loss_options


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
    assert PolicyUpdate._clip_gradients(module, None) == 5.0
    assert torch.allclose(weight.grad / 1024, torch.tensor([0.6, 0.8]))


@pytest.mark.parametrize(("epsilon_high", "expected"), [(None, 0.2), (0.0, 0.0), (0.28, 0.28)])
def test_epsilon_high_defaults_to_epsilon_and_zero_is_kept(tiny_model_dir, epsilon_high, expected):
    module = ExGRPOModule(model_name_or_path=tiny_model_dir, epsilon=0.2, epsilon_high=epsilon_high)
    assert loss_options(module.hparams)["epsilon_high"] == expected


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


class NaNGradients(Callback):
    """Turns one parameter's gradient to NaN in the backwards of the chosen steps (the loss stays finite),
    and records whether each step changed the weights."""

    def __init__(self, batches):
        self.batches, self.handle, self.changed = set(batches), None, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = [p.detach().clone() for p in pl_module.policy.parameters()]
        if batch_idx in self.batches:
            parameter = next(pl_module.policy.parameters())
            self.handle = parameter.register_hook(lambda grad: grad * float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        after = list(pl_module.policy.parameters())
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self.before, after)))


def _deepspeed_fit(model_dir: str, out: str, poisoned: list[int], max_nonfinite_steps: int) -> None:
    """In a child process: a one-process DeepSpeed ZeRO-2 fit on the CPU (gloo), results to `out`."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    callback = NaNGradients(poisoned)
    module = tiny_module(model_dir, max_nonfinite_steps=max_nonfinite_steps)
    trainer = Trainer(
        accelerator="cpu", strategy=CPUDeepSpeedStrategy(stage=2),
        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, callbacks=[callback],
    )  # fmt: skip
    data = PromptDataModule(synthetic=ArithmeticTask(num_questions=64, seed=1), batch_size=2)
    record = {"error": None}
    try:
        trainer.fit(module, datamodule=data)
    except RuntimeError as err:
        record["error"] = str(err)
    record.update(skipped=module.nonfinite.skipped, changed=callback.changed)
    Path(out).write_text(json.dumps(record))


@pytest.mark.slow
@pytest.mark.parametrize(("poisoned", "limit"), [([1], 3), ([0, 1, 2, 3], 2)], ids=["one", "in a row"])
def test_a_step_deepspeed_skips_counts_as_a_non_finite_step(tiny_model_dir, tmp_path, poisoned, limit):
    pytest.importorskip("deepspeed")
    out = tmp_path / "record.json"
    # Spawned, not forked: a fork of the test process, which earlier tests left with threads (gloo, reward
    # workers' readers), can inherit a lock held by one of them and hang.
    child = multiprocessing.get_context("spawn").Process(
        target=_deepspeed_fit, args=(tiny_model_dir, str(out), poisoned, limit)
    )
    child.start()
    child.join(timeout=600)
    assert child.exitcode == 0
    record = json.loads(out.read_text())
    if len(poisoned) < limit:
        assert record["error"] is None and record["skipped"] == 1
        assert record["changed"] == [True, False, True, True]  # DeepSpeed skipped the poisoned step
    else:
        assert "2 updates in a row had a non-finite" in record["error"]
        assert record["changed"] == [False]

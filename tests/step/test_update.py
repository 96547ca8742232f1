"""The update's handling of loss scaling and of steps that DeepSpeed skips (`exgrpo_pl.step.update`)."""

import csv
import json
import multiprocessing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CPUDeepSpeedStrategy, tiny_module
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision
from test_module import make_data, tiny_trainer

import exgrpo_pl.step.update as update_module
from exgrpo_pl.data import ArithmeticTask, PromptDataModule
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.step.mini_batches import mini_batch_rows
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


class _Steps(Callback):
    """Counts training batches; keeps each batch's epoch."""

    def __init__(self):
        self.epochs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.epochs.append(trainer.current_epoch)


def _spy_updates(monkeypatch):
    """Records every loss call (log-probs, old log-probs, rows normalised over, clip) and every forward (rows,
    with gradients or not)."""
    losses, forwards = [], []
    real_loss, real_forward = update_module.compute_grpo_loss, PolicyUpdate._forward

    def loss(logps, old_logps, advantages, mask, normaliser, **kwargs):
        losses.append((logps.detach().clone(), old_logps.clone(), normaliser.num_sequences, kwargs["clip"]))
        return real_loss(logps, old_logps, advantages, mask, normaliser, **kwargs)

    def forward(self, rollouts, rows, with_entropy):
        forwards.append((rows.tolist(), torch.is_grad_enabled()))
        return real_forward(self, rollouts, rows, with_entropy)

    monkeypatch.setattr(update_module, "compute_grpo_loss", loss)
    monkeypatch.setattr(PolicyUpdate, "_forward", forward)
    return losses, forwards


def test_two_updates_per_batch_each_train_half_the_groups_once_against_old_logps(
    tiny_model_dir, tmp_path, monkeypatch
):
    losses, forwards = _spy_updates(monkeypatch)
    steps = _Steps()
    module = tiny_module(tiny_model_dir, steps_per_generation=2)
    trainer = tiny_trainer(tmp_path, max_steps=4, limit_val_batches=0, callbacks=[steps])
    trainer.fit(module, datamodule=make_data())  # 4 questions x K = 4: 16 rows, 4 groups a batch
    # global_step, max_steps and the schedule count optimizer updates: 2 batches of 2 updates each.
    assert len(steps.epochs) == 2 and trainer.global_step == 4
    assert module.lr_schedulers().last_epoch == 4 and module._total_steps == 4
    everything, first, second = list(range(16)), [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    # Per batch: every row scored once without gradients, then each update trains its groups once.
    assert forwards == [(everything, False), (first, True), (second, True)] * 2
    assert [rows for _, _, rows, _ in losses] == [8, 8, 8, 8]  # each update normalised by its own rows
    for update, (logps, old, _, clip) in enumerate(losses):
        assert clip  # no replay callback: the clip always acts
        moved = (logps - old).abs().max()
        # The first update starts where the batch was scored; the second's old log-probs are from before the
        # first update, so its ratio is not 1 and the clip can act.
        assert moved < 1e-6 if update % 2 == 0 else moved > 1e-5


@pytest.mark.parametrize(
    ("clip_after_replay_starts", "expected"), [(False, [True, False]), (True, [True, True])]
)
def test_fresh_rows_lose_the_clip_once_replay_starts_only_when_asked(
    tiny_model_dir, tmp_path, monkeypatch, clip_after_replay_starts, expected
):
    from exgrpo_pl.callbacks import ReplayCallback

    losses, _ = _spy_updates(monkeypatch)
    steps = _Steps()
    replay = ReplayCallback(
        mode="mix", replay_start_epoch=1, min_buffer_size=1
    )  # the phase starts at epoch 1
    module = tiny_module(tiny_model_dir, clip_after_replay_starts=clip_after_replay_starts)
    trainer = tiny_trainer(
        tmp_path,
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=0,
        callbacks=[replay, steps],
    )
    trainer.fit(module, datamodule=make_data())
    assert steps.epochs == [0, 1]
    assert [clip for *_, clip in losses] == expected


def test_max_steps_not_a_whole_number_of_batches_is_an_error_naming_both(tiny_model_dir, tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=3)
    module = tiny_module(tiny_model_dir, steps_per_generation=2)
    with pytest.raises(
        ValueError, match=r"max_steps=3: not a multiple of the 2 .*steps_per_generation=2 x num"
    ):
        trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 0 and module.policy is None  # before the model is built


def test_a_swap_step_of_few_stored_rows_deals_them_one_by_one_and_names_swap_when_too_few():
    # 3 stored rows with K = 2 and 2 updates: dealt K at a time when they make 2 sets, else one at a time
    assert [rows.tolist() for rows in mini_batch_rows(4, 2, 2, stored_only=True)] == [[0, 1], [2, 3]]
    assert [rows.tolist() for rows in mini_batch_rows(3, 4, 2, stored_only=True)] == [[0, 2], [1]]
    with pytest.raises(
        ValueError, match=r"swap replay step drew only 1 stored row\(s\) from the replay buffer"
    ):
        mini_batch_rows(1, 2, 2, stored_only=True)
    with pytest.raises(ValueError, match=r"a step has only 1 groups of 2 rows .* raise data.batch_size"):
        mini_batch_rows(2, 2, 2)  # a step of fresh groups: the batch is what is short


def test_more_updates_than_questions_is_an_error_before_training(tiny_model_dir, tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=5)
    with pytest.raises(
        ValueError, match=r"steps_per_generation=5: .*batch's 4 questions \(data.batch_size\)"
    ):
        trainer.fit(tiny_module(tiny_model_dir, steps_per_generation=5), datamodule=make_data())


def test_the_entropy_bonus_counts_the_official_micro_batches_of_each_update(
    tiny_model_dir, tmp_path, monkeypatch
):
    """With entropy_token_budget each update's bonus weight is entropy_coef times ceil(its prompt +
    completion tokens / the budget) (`official_micro_batches`)."""
    seen = []
    real_loss = update_module.compute_grpo_loss

    def recording(logps, *args, entropy_coef, **kwargs):
        seen.append(entropy_coef)
        return real_loss(logps, *args, entropy_coef=entropy_coef, **kwargs)

    monkeypatch.setattr(update_module, "compute_grpo_loss", recording)
    counted = []
    real_counts = PolicyUpdate.entropy_counts

    def counts(self, rollouts, updates):
        tokens = [int(rollouts.prompt_mask[r].sum() + rollouts.completion_mask[r].sum()) for r in updates]
        counted.append([-(-t // 10) for t in tokens])  # the official ceil(tokens / budget)
        return real_counts(self, rollouts, updates)

    monkeypatch.setattr(PolicyUpdate, "entropy_counts", counts)
    module = tiny_module(tiny_model_dir, entropy_coef=0.01, entropy_token_budget=10, steps_per_generation=2)
    trainer = tiny_trainer(tmp_path, max_steps=4, logger=False)
    trainer.fit(module, datamodule=make_data())
    expected = [0.01 * m for step in counted for m in step]
    assert max(m for step in counted for m in step) > 1  # the budget is small enough to split
    assert seen == pytest.approx(expected)  # one micro-batch (the whole update) per update


def test_an_update_whose_gradient_norm_exceeds_skip_grad_norm_is_skipped_and_the_run_goes_on(
    tiny_model_dir, tmp_path
):
    module = tiny_module(tiny_model_dir, skip_grad_norm=1e-12, max_nonfinite_steps=1)
    trainer = tiny_trainer(tmp_path, max_steps=3, log_every_n_steps=1)
    trainer.fit(module, datamodule=make_data())
    assert trainer.global_step == 3  # skipped updates count as steps, as the official code's batches do
    assert module.nonfinite.too_large == 3 and module.nonfinite.skipped == 0
    assert float(trainer.logged_metrics["train/grad_norm_skips"]) == 3.0
    assert float(trainer.logged_metrics["train/grad_norm"]) > 1e-12


def test_skip_grad_norm_leaves_the_weights_as_they_were_and_a_high_limit_changes_nothing(tiny_model_dir):
    weights = {}
    for limit in (1e-12, 1e6, None):
        module = tiny_module(tiny_model_dir, skip_grad_norm=limit, learning_rate=1e-2)
        torch.manual_seed(0)
        module.configure_model()
        start = [p.detach().clone() for p in module.policy.parameters()]
        trainer = Trainer(
            accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        )  # fmt: skip
        torch.manual_seed(0)
        trainer.fit(module, datamodule=make_data())
        weights[limit] = [p.detach() for p in module.policy.parameters()]
        if limit == 1e-12:
            assert all(torch.equal(a, b) for a, b in zip(start, weights[limit]))
    assert all(torch.equal(a, b) for a, b in zip(weights[1e6], weights[None]))
    assert not all(torch.equal(a, b) for a, b in zip(weights[1e-12], weights[None]))


def test_is_weight_is_the_mean_over_the_micro_batches_that_hold_replayed_rows(
    tiny_model_dir, tmp_path, monkeypatch
):
    from exgrpo_pl.callbacks import ReplayCallback
    from exgrpo_pl.experience import SelectiveReplay

    reported = []  # per loss call of the step: (rows, is_weight or None)
    real_loss = update_module.compute_grpo_loss

    def loss(logps, *args, **kwargs):
        value, stats = real_loss(logps, *args, **kwargs)
        reported.append((logps.shape[0], stats.get("is_weight")))
        return value, stats

    class Calls(Callback):
        def __init__(self):
            self.steps = []  # per step, its loss calls

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.steps.append(list(reported))
            reported.clear()

    monkeypatch.setattr(update_module, "compute_grpo_loss", loss)
    calls = Calls()
    replay = ReplayCallback(
        replay=SelectiveReplay(strategy="uniform", replay_probability=1.0), mode="mix", min_buffer_size=1
    )
    module = tiny_module(tiny_model_dir, micro_batch_size=4)  # one group of K = 4 per micro-batch
    trainer = tiny_trainer(
        tmp_path, max_steps=4, limit_val_batches=0, log_every_n_steps=1, callbacks=[replay, calls]
    )
    trainer.fit(module, datamodule=make_data())
    rows = csv.DictReader(Path(trainer.logger.log_dir, "metrics.csv").read_text().splitlines())
    logged = {int(row["step"]): float(row["train/is_weight"]) for row in rows if row["train/is_weight"]}
    mixed = {step: each for step, each in enumerate(calls.steps) if any(w is not None for _, w in each)}
    assert mixed and set(logged) == set(mixed)
    for step, each in mixed.items():
        assert any(w is None for _, w in each)  # fresh-only micro-batches beside the replayed ones
        weighed = [(n, float(w)) for n, w in each if w is not None]
        expected = sum(n * w for n, w in weighed) / sum(n for n, _ in weighed)
        assert logged[step] == pytest.approx(expected, rel=1e-5)

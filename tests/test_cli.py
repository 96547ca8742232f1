"""The `exgrpo` command: fit, validate and test run end to end on a tiny model and say where things are."""

import pytest

from exgrpo_pl.cli import main


@pytest.fixture
def tiny_args(tiny_model_dir, tmp_path):
    return [
        f"--model.model_name_or_path={tiny_model_dir}", "--model.num_generations=2",
        "--model.max_completion_length=3", "--data.synthetic=exgrpo_pl.data.ArithmeticTask",
        "--data.synthetic.num_questions=40", "--data.batch_size=4", "--trainer.accelerator=cpu",
        "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}",
    ]  # fmt: skip


def test_fit_prints_logs_and_checkpoint(tiny_args, capsys):
    main(["fit", *tiny_args, "--trainer.max_steps=2"])
    out = capsys.readouterr().out
    assert "Training finished." in out and "tensorboard --logdir" in out and ".ckpt" in out


@pytest.mark.parametrize("subcommand, metric", [("validate", "val/pass@1"), ("test", "test/pass@1")])
def test_validate_and_test_report_pass_at_1(tiny_args, subcommand, metric, capsys):
    main([subcommand, *tiny_args])
    assert metric in capsys.readouterr().out

"""Shared test pieces: a tiny random causal LM saved with `save_pretrained` (as a user's checkpoint would be),
and the tiny GRPO module most Trainer tests train; the verl-layout sample file and a tiny model that reads
it; `is_gone` for tests of worker processes; a CPU stand-in for Lightning's DeepSpeed strategy; the property
tests' settings."""

import builtins
import errno
import io
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import settings
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from transformers import LlamaForCausalLM

from exgrpo_pl.data import ARITHMETIC_ALPHABET
from exgrpo_pl.models import build_char_tokenizer, tiny_llama_config
from exgrpo_pl.module import ExGRPOModule
from exgrpo_pl.rewards import FormatReward

# Test files import each other's helpers by file name (`from test_buffer import group`, every test file's name
# being unique under tests/): tests/ is on sys.path (this file's folder), and so are the folders that mirror
# the package's subpackages, whichever test file pytest collects first.
for _folder in ("checkpoints", "experience", "module", "step"):
    if str(Path(__file__).parent / _folder) not in sys.path:
        sys.path.append(str(Path(__file__).parent / _folder))

# Property tests check values, never time: Hypothesis's default 200 ms deadline per example fails them on a
# loaded 2-core machine (an example's first run pays torch's warm-up), so no test has one.
settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer, 32-wide Llama and a character tokenizer, saved like any local checkpoint."""
    path = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_char_tokenizer(ARITHMETIC_ALPHABET)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=32, num_layers=1))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def tiny_module(model_dir, **overrides) -> ExGRPOModule:
    """An ExGRPOModule on the tiny model, K = 4, 4-token completions.

    A random model never solves arithmetic; a format reward varies across its samples, so groups have
    non-zero advantages and the policy really moves. Without a reward time limit: a limited reward runs in
    a worker process that each test process (and DDP rank) would start, seconds each; tests/rewards tests
    the limit.
    """
    settings = dict(
        model_name_or_path=model_dir, num_generations=4, max_completion_length=4, learning_rate=1e-3,
        reward_funcs=[FormatReward(r"[0-9].*")], reward_timeout_seconds=None,
    )  # fmt: skip
    return ExGRPOModule(**{**settings, **overrides})


def is_gone(pid):
    """True once `pid` has exited and been reaped (a zombie still exists for `os.kill`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy without its CUDA-only check, on `devices` CPU processes (gloo):
    DeepSpeed's real engine, testable here (scripts/gpu_smoke.sh checks the CUDA path)."""

    def __init__(self, stage: int, devices: int = 1, start_method: str = "popen") -> None:
        super().__init__(stage=stage, parallel_devices=[torch.device("cpu", i) for i in range(devices)])
        self._start_method = start_method  # "fork": children within this test, as with strategy="ddp_fork"

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's isinstance(CUDAAccelerator) check


VERL = Path(__file__).parent / "data" / "samples" / "verl" / "verl_math.parquet"


@pytest.fixture(scope="session")
def verl_model_dir(tmp_path_factory):
    """A tiny Llama whose character tokenizer (no chat template) reads every character of the verl sample's
    messages and the newline that joins them."""
    contents = {message["content"] for row in pq.read_table(VERL).to_pylist() for message in row["prompt"]}
    tokenizer = build_char_tokenizer(
        "".join(sorted(set("".join(contents)) | set("\n" + ARITHMETIC_ALPHABET)))
    )
    torch.manual_seed(0)
    config = tiny_llama_config(len(tokenizer), hidden_size=32, num_layers=1)
    config.max_position_embeddings = 128  # the longest question is 67 characters, plus the completion
    path = tmp_path_factory.mktemp("verl-model")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class FillsTheDisk:
    """A file open for writing on a disk that fills up: a write stores half its bytes, then fails."""

    def __init__(self, file):
        self.file = file

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def write(self, data):
        self.file.write(data[: len(data) // 2])
        self.file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")


def fill_the_disk_for(monkeypatch, name: str) -> None:
    """Files opened for writing whose name holds `name` (temp files named after it too) find the disk full,
    however they are opened (`open`, `Path.write_text`)."""
    real_open = io.open

    def opens(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        writes = any(flag in mode for flag in "wxa")
        return FillsTheDisk(handle) if writes and name in os.path.basename(os.fspath(file)) else handle

    monkeypatch.setattr(io, "open", opens)
    monkeypatch.setattr(builtins, "open", opens)


def tensorboard_experiment(logdir):
    """The HParams experiment TensorBoard's own backend serves for `tensorboard --logdir logdir` (its
    options sorted as the tab sorts them: `differs` first, then by name), read from the event files."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    backend = backend_context.Context(base_plugin.TBContext(data_provider=provider, logdir=str(logdir)))
    request = api_pb2.GetExperimentRequest(hparams_limit=1000)
    return get_experiment.Handler(context.RequestContext(), backend, "", request).run()

"""Shared fixtures: a tiny random causal LM saved with `save_pretrained`, as a user's checkpoint would be."""

import pytest
import torch
from transformers import LlamaForCausalLM

from exgrpo_pl.data import ARITHMETIC_ALPHABET
from exgrpo_pl.models import build_char_tokenizer, tiny_llama_config


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

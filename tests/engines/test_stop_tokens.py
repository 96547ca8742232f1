"""Stop tokens: the tokenizer's EOS, every EOS of the generation config, the chat template's end of turn and
the `stop_token_ids` option all end a completion, under both engines."""

import pytest
import torch
from conftest import tiny_module
from transformers import GenerationConfig, LlamaForCausalLM

from exgrpo_pl.data import ARITHMETIC_ALPHABET
from exgrpo_pl.engines.generation import completion_mask_from_ids
from exgrpo_pl.models import (
    build_char_tokenizer,
    completion_stop_ids,
    end_of_turn_id,
    load_tokenizer,
    tiny_llama_config,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """Saved like a chat checkpoint: tokenizer EOS `</s>`, generation config EOS [`</s>`, `<|endoftext|>`],
    and a template that ends each turn with `<|im_end|>`. Its output layer is zero: every token is equally
    likely, so sampled completions end on each stop token in turn."""
    path = tmp_path_factory.mktemp("chat-model")
    tokenizer = build_char_tokenizer(ARITHMETIC_ALPHABET + "abcdefghijklmnopqrstuvwxyz\n")
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    model = LlamaForCausalLM(tiny_llama_config(len(tokenizer), hidden_size=32, num_layers=1))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=eos, pad_token_id=0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def ids_of(tokenizer, *tokens):
    return [tokenizer.convert_tokens_to_ids(token) for token in tokens]


def test_the_stop_ids_are_the_union_of_every_source(chat_model_dir, tiny_model_dir):
    tokenizer = load_tokenizer(chat_model_dir)
    eos, endoftext, im_end, equals = ids_of(tokenizer, "</s>", "<|endoftext|>", "<|im_end|>", "=")
    assert end_of_turn_id(tokenizer) == im_end
    assert completion_stop_ids(tokenizer, chat_model_dir) == [eos, endoftext]
    assert completion_stop_ids(tokenizer, chat_model_dir, [equals, eos], chat_template=True) == [
        eos, endoftext, im_end, equals,
    ]  # fmt: skip
    module = tiny_module(chat_model_dir, chat_template=True, stop_token_ids=[equals])
    assert module.eos_token_ids == [eos, endoftext, im_end, equals]
    plain = load_tokenizer(tiny_model_dir)  # one EOS everywhere, no template
    assert completion_stop_ids(plain, tiny_model_dir) == [plain.eos_token_id]
    with pytest.raises(ValueError, match=r"stop_token_ids=\[999\]: \[999\] are not token ids in \[0, "):
        completion_stop_ids(tokenizer, chat_model_dir, [999])


def test_a_template_that_ends_turns_with_plain_text_adds_no_stop_token(chat_model_dir):
    tokenizer = load_tokenizer(chat_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_id(tokenizer) is None  # a newline is no end of turn


@pytest.mark.parametrize("engine", ["hf", "static"])
def test_every_stop_id_ends_a_completion(chat_model_dir, engine):
    """Uniform next-token probabilities: of 64 rows most stop, and each stop id ends some of them."""
    module = tiny_module(
        chat_model_dir, chat_template=True, stop_token_ids=ids_of(load_tokenizer(chat_model_dir), "="),
        max_completion_length=40, rollout_engine=engine,
        rollout_engine_options={"compile": False} if engine == "static" else None,
    )  # fmt: skip
    module.configure_model()
    stops = module.eos_token_ids
    prompt = module.collector.encode(["1+2="], torch.tensor([0]))[0].expand(64, -1)  # the templated prompt
    torch.manual_seed(0)
    out = module.engine.generate(prompt, torch.ones_like(prompt, dtype=torch.bool), module._sampling(1.0))
    mask, truncated = completion_mask_from_ids(out.ids, stops)
    assert torch.equal(out.mask, mask) and torch.equal(out.truncated, truncated)
    ends = out.ids[torch.arange(64), out.mask.sum(1) - 1][~out.truncated]
    assert set(ends.tolist()) == set(stops)  # each one ended a completion
    assert out.truncated.float().mean() < 0.2

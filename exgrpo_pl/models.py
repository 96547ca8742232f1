"""Loading the policy and its tokenizer: any transformers causal LM, or the embedded tiny arithmetic model.

`model_name_or_path` is a local directory or a hub id (loaded with `from_pretrained`), or
`embedded:tiny-arith`: a 0.3M-parameter Llama with a character tokenizer, shipped in the package
(`exgrpo_pl/assets/tiny-arith`, made by `python scripts/make_tiny_policy.py`) so the quickstart needs no hub.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

EMBEDDED_PREFIX = "embedded:"
ASSETS = Path(__file__).parent / "assets"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model_name_or_path: str) -> str:
    """Map `embedded:NAME` to the shipped directory; anything else is passed to `from_pretrained` as is."""
    if not model_name_or_path.startswith(EMBEDDED_PREFIX):
        return model_name_or_path
    name = model_name_or_path[len(EMBEDDED_PREFIX) :]
    path = ASSETS / name
    if not (path / "config.json").is_file():
        shipped = (
            sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())
            if ASSETS.is_dir()
            else []
        )
        raise ValueError(
            f"model_name_or_path={model_name_or_path!r}: no embedded model {name!r}; shipped: {shipped}"
        )
    return str(path)


def load_tokenizer(model_name_or_path: str):
    """The model's tokenizer, left-padded for generation, with a pad token.

    A tokenizer without a pad token gets its EOS token as pad (TRL does the same); completions are masked
    after their first EOS, so the two never get confused in the loss.
    """
    path = resolve_model_path(model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {model_name_or_path!r} has neither a pad nor an EOS token")
        warnings.warn(f"tokenizer of {model_name_or_path!r} has no pad token; using EOS as pad", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(
    model_name_or_path: str,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
):
    """A causal LM from a local directory, a hub id or the embedded assets.

    Args:
        dtype: one of "float32", "bfloat16", "float16".
        attn_implementation: passed to `from_pretrained` ("sdpa", "eager", "flash_attention_2", ...).
        gradient_checkpointing: trade compute for activation memory in the training forward.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    path = resolve_model_path(model_name_or_path)
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"model_name_or_path={model_name_or_path!r} is a directory without config.json: not a model"
        )
    kwargs = {"dtype": DTYPES[dtype]}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # the cache is useless and wasteful with checkpointing in training
    return model


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over `alphabet` plus <pad>, <s>, </s> (ids 0, 1, 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for char in alphabet:
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="left"
    )


def tiny_llama_config(vocab_size: int, hidden_size: int = 128, num_layers: int = 2) -> LlamaConfig:
    """A Llama small enough to train on two CPU cores in minutes."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


def lora_config(options: dict):
    """A `peft.LoraConfig` for a causal LM from keyword options; bad keys fail here, before training."""
    try:
        from peft import LoraConfig
    except ImportError as err:
        raise ImportError("lora needs the peft package: pip install 'exgrpo-pl[peft]'") from err
    try:
        return LoraConfig(task_type="CAUSAL_LM", **options)
    except TypeError as err:
        raise ValueError(f"lora={options!r}: not valid peft.LoraConfig options ({err})") from err

"""Loading the policy and its tokenizer: any transformers causal LM, or the embedded tiny arithmetic model.

`model_name_or_path` is a local directory or a hub id (loaded with `from_pretrained`), or
`embedded:tiny-arith`: a 0.3M-parameter Llama with a character tokenizer, shipped in the package
(`exgrpo_pl/assets/tiny-arith`, made by `python scripts/make_tiny_policy.py`) so the quickstart needs no hub.

A name is a local path when it exists on disk, or when it cannot be a hub id: it starts with "/", "./",
"../" or "~", or is not of the form `name` or `namespace/name` (letters, digits, "-", "_", "."), e.g.
`runs/a/checkpoint`. A local path must be a directory holding `config.json`; anything else is an error
saying "not a model", before transformers would try the hub with it. Any other name, e.g.
`Qwen/Qwen2.5-Math-1.5B`, goes to `from_pretrained` unchanged.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from jinja2 import TemplateError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

EMBEDDED_PREFIX = "embedded:"
ASSETS = Path(__file__).parent / "assets"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The form of a hub repo id (huggingface_hub's validate_repo_id checks the same characters).
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")


def is_local_path(model_name_or_path: str) -> bool:
    """Whether a model name is a local path: it exists, or cannot be a hub id (see the module docstring)."""
    if model_name_or_path.startswith(("/", "./", "../", "~")) or not _HUB_ID.fullmatch(model_name_or_path):
        return True
    return Path(model_name_or_path).exists()


def _check_model_directory(model_name_or_path: str, path: Path) -> None:
    """Raises an error saying "not a model" unless `path` is a directory holding `config.json`.

    Raises:
        FileNotFoundError: when `path` does not exist.
        ValueError: when it is a file, or a directory without `config.json` (naming what it holds, and a
            subdirectory that is a model, e.g. a hub cache's `snapshots/<hash>`).
    """
    where = f"model_name_or_path={model_name_or_path!r}"
    if not path.exists():
        raise FileNotFoundError(
            f"{where}: {path.absolute()} does not exist: not a model (taken as a local path; a hub id "
            "looks like 'namespace/name')"
        )
    if not path.is_dir():
        raise ValueError(f"{where}: {path} is a file: not a model (expected a directory holding config.json)")
    if (path / "config.json").is_file():
        return
    nested = next(iter(sorted(path.glob("*/config.json")) + sorted(path.glob("*/*/config.json"))), None)
    hint = f"; {nested.parent} has one" if nested is not None else ""
    if (path / "adapter_config.json").is_file():  # what `exgrpo export` writes for a LoRA run
        hint += "; it is a LoRA adapter: export the run with --merge_lora true for a whole model"
    raise ValueError(
        f"{where}: {path} is a directory without config.json: not a model ({_contents(path)}){hint}"
    )


def _contents(path: Path) -> str:
    """What a directory holds, for error messages: its first few names, or that it is empty."""
    names = sorted(entry.name for entry in path.iterdir())
    if not names:
        return "it is empty"
    return f"it holds {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"


def resolve_model_path(model_name_or_path: str) -> str:
    """The path or hub id to give `from_pretrained`.

    `embedded:NAME` becomes the shipped directory; a local path (see `is_local_path`) has "~" expanded and
    must be a model directory; any other name is a hub id, returned as is.

    Raises:
        FileNotFoundError: for a local path that does not exist.
        ValueError: for an empty name, an unknown embedded model, or a local path that is not a directory with
            config.json.
    """
    if not model_name_or_path.strip():
        raise ValueError("model_name_or_path is empty: not a model")
    if not model_name_or_path.startswith(EMBEDDED_PREFIX):
        if not is_local_path(model_name_or_path):
            return model_name_or_path
        path = Path(model_name_or_path).expanduser()
        _check_model_directory(model_name_or_path, path)
        return str(path)
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

    Raises:
        FileNotFoundError, ValueError: for a local path that is not a model (see `resolve_model_path`), or
            a model directory transformers finds no tokenizer in (naming the files it holds).
    """
    path = resolve_model_path(model_name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    except (OSError, ValueError) as err:
        if not Path(path).is_dir():
            raise  # a hub id: transformers' own error says what went wrong
        cause = " ".join(str(err).split())[:200] or type(err).__name__  # transformers' errors span lines
        raise ValueError(
            f"model_name_or_path={model_name_or_path!r}: no tokenizer could be loaded from {path} "
            f"({_contents(Path(path))}): {cause}; the directory needs the tokenizer's files too "
            "(tokenizer.save_pretrained)"
        ) from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {model_name_or_path!r} has neither a pad nor an EOS token")
        warnings.warn(f"tokenizer of {model_name_or_path!r} has no pad token; using EOS as pad", stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def completion_stop_ids(
    tokenizer, model_name_or_path: str, extra: Sequence[int] = (), chat_template: bool = False
) -> list[int]:
    """Every token id that ends a completion, the tokenizer's EOS first.

    The union of the tokenizer's EOS, the model's generation config's `eos_token_id` (an int or a list:
    Qwen lists `<|endoftext|>` and `<|im_end|>`), the chat template's end-of-turn token when prompts are
    wrapped in the template (`end_of_turn_id`), and `extra` (the module's `stop_token_ids`).

    Raises:
        ValueError: for an `extra` id outside the vocabulary, or when no id at all would end a completion.
    """
    vocabulary = len(tokenizer)
    bad = [i for i in extra if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocabulary]
    if bad:
        raise ValueError(f"stop_token_ids={list(extra)!r}: {bad} are not token ids in [0, {vocabulary})")
    ids = [tokenizer.eos_token_id, *_generation_config_eos(model_name_or_path)]
    if chat_template:
        ids.append(end_of_turn_id(tokenizer))
    ids = list(dict.fromkeys(i for i in [*ids, *extra] if i is not None))
    if not ids:
        raise ValueError(
            f"nothing ends a completion of {model_name_or_path!r}: its tokenizer and generation config name "
            "no EOS token; set stop_token_ids"
        )
    return ids


def _generation_config_eos(model_name_or_path: str) -> list[int]:
    """The `eos_token_id` of the model's generation_config.json, as a list; [] without one."""
    try:
        config = GenerationConfig.from_pretrained(resolve_model_path(model_name_or_path))
    except OSError:  # the checkpoint has no generation_config.json
        return []
    eos = config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the chat template writes right after an assistant message, if any.

    Found by rendering a conversation whose assistant turn is a marker and reading the first token after it
    (`<|im_end|>` for Qwen, `<|eot_id|>` for Llama 3). None when that is not a special token (a template that
    ends turns with plain text, or only with EOS) or the template cannot render an assistant turn.
    """
    marker = "EXGRPO_END_OF_TURN_PROBE"
    conversation = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except TemplateError:
        return None
    after = text[text.rfind(marker) + len(marker) :] if marker in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    if not ids:
        return None
    added = tokenizer.added_tokens_decoder.get(ids[0])
    special = ids[0] in tokenizer.all_special_ids or (added is not None and added.special)
    return ids[0] if special else None


def max_positions(model_name_or_path: str) -> int | None:
    """The model's `max_position_embeddings` (its config read, no weights loaded), or None where the config
    has none (or names it otherwise: then no limit is checked)."""
    config = AutoConfig.from_pretrained(resolve_model_path(model_name_or_path))
    positions = getattr(config, "max_position_embeddings", None)
    return positions if isinstance(positions, int) else None


def load_policy(
    model_name_or_path: str,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    gradient_checkpointing: bool = False,
):
    """A causal LM from a local directory, a hub id or the embedded assets.

    Args:
        model_name_or_path: a model directory, a hub id or `embedded:NAME` (see `resolve_model_path`).
        dtype: one of "float32", "bfloat16", "float16".
        attn_implementation: passed to `from_pretrained` ("sdpa", "eager", "flash_attention_2", ...).
        gradient_checkpointing: trade compute for activation memory in the training forward.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    path = resolve_model_path(model_name_or_path)
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

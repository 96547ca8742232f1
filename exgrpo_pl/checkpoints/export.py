"""A trained policy as a Hugging Face model folder, from any checkpoint `exgrpo fit` writes.

    exgrpo export --ckpt_path runs/lightning_logs/version_0/checkpoints/last.ckpt --out runs/policy
    exgrpo export --ckpt_path last.ckpt --out runs/policy-merged --merge_lora true   # a LoRA run, merged
    exgrpo export --ckpt_path last --root runs --out runs/policy   # the newest intact checkpoint of a run

`export_policy` reads a Lightning checkpoint file or a DeepSpeed ZeRO-2/3 checkpoint folder (consolidated in
memory with DeepSpeed's `zero_to_fp32`, as `lightning.pytorch.utilities.deepspeed` does), takes the module's
`policy.*` weights and the options it was built with (`model_name_or_path`, `dtype`, `lora`, `chat_template`,
`stop_token_ids`), and writes what vLLM, lm-evaluation-harness, the Hub and `exgrpo test` read: the weights as
safetensors with their `config.json`, the tokenizer, and a `generation_config.json` whose `eos_token_id` lists
the run's stop tokens (`exgrpo_pl.models.completion_stop_ids`). A LoRA run gives the adapter as PEFT saves it
(`adapter_config.json`, `adapter_model.safetensors`, naming its base model), or with `merge_lora` the base
model with the adapter merged in. The folder is written under a temp name and renamed into place, so a kill
leaves no half-written model behind; its files get the umask's modes (safetensors writes 0600), and it lists
them in `MANIFEST`, which is what lets a later `overwrite` replace it: a folder holding anything an export
did not write (a run's checkpoints, logs, a file of the user's) is never deleted.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from exgrpo_pl.checkpoints.atomic_writes import (
    raise_if_out_of_space,
    remove_stale_temp_files,
    temp_path,
    tensor_bytes,
)
from exgrpo_pl.checkpoints.integrity import check_loadable, newest_complete_checkpoint
from exgrpo_pl.checkpoints.saving import AtomicCheckpointIO
from exgrpo_pl.models import DTYPES, completion_stop_ids, load_tokenizer, lora_config, resolve_model_path

POLICY_PREFIX = "policy."
# Lightning before 2.1 saved DeepSpeed's weights under its wrapper's attribute (its converter strips it too).
_WRAPPER_PREFIX = "_forward_module."
# Written last into every export: the checkpoint it came from and the files it wrote, itself excluded.
MANIFEST = "exgrpo_export.json"


def read_checkpoint(ckpt_path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The module's state dict and hyperparameters from a checkpoint file or a DeepSpeed checkpoint folder.

    A file is loaded as a resume would load it (`AtomicCheckpointIO`: tensors and primitives only). A folder's
    weights are consolidated from its ZeRO shards into full fp32 tensors; its hyperparameters come from rank
    0's `*model_states.pt`, where Lightning's `DeepSpeedStrategy` puts them.

    Raises:
        ValueError: the path is not a complete, intact checkpoint (naming it and the reason).
        ImportError: a DeepSpeed folder without deepspeed installed.
    """
    check_loadable(ckpt_path, "ckpt_path")
    path = Path(ckpt_path)
    if not path.exists():
        raise FileNotFoundError(f"ckpt_path={ckpt_path}: no such file or folder")
    if path.is_file():
        checkpoint = AtomicCheckpointIO().load_checkpoint(path, map_location="cpu")
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise ValueError(
                f"ckpt_path={ckpt_path}: not a Lightning checkpoint (no state_dict entry; a bare state dict "
                "or weights file has no options that name the model)"
            )
        return checkpoint["state_dict"], dict(checkpoint.get("hyper_parameters") or {})
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as err:
        raise ImportError(
            f"ckpt_path={ckpt_path} is a DeepSpeed checkpoint folder: exporting it needs deepspeed "
            "(pip install 'exgrpo-pl[deepspeed]')"
        ) from err
    if not (path / "latest").is_file():
        raise ValueError(f"ckpt_path={ckpt_path}: a folder without DeepSpeed's 'latest' file: no checkpoint")
    tag = (path / "latest").read_text().strip()
    model_states = sorted((path / tag).glob("*model_states.pt"))  # rank 0's sorts first
    if not model_states:
        raise ValueError(f"ckpt_path={ckpt_path}: no *model_states.pt file in {path / tag}")
    client = torch.load(model_states[0], map_location="cpu", weights_only=False)  # DeepSpeed pickles it
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(path), tag)
    state_dict = {key.removeprefix(_WRAPPER_PREFIX): value for key, value in state_dict.items()}
    return state_dict, dict(client.get("hyper_parameters") or {})


def export_policy(
    ckpt_path: str | os.PathLike, out: str | os.PathLike, merge_lora: bool = False, overwrite: bool = False
) -> Path:
    """Writes the checkpoint's policy to `out` as a Hugging Face model folder.

    The folder holds the weights as safetensors with their `config.json`, the tokenizer, a
    `generation_config.json` whose `eos_token_id` lists the run's stop tokens, and `MANIFEST` (the files an
    export wrote); a LoRA run gives the adapter as PEFT saves it, or with `merge_lora` the merged model. It is
    written under a temporary name and renamed into place, so a kill leaves no half-written folder.

    Args:
        ckpt_path: a checkpoint file, or a DeepSpeed checkpoint folder, of an `ExGRPOModule` run.
        out: the folder to write; it must not exist unless `overwrite`.
        merge_lora: for a LoRA run, merge the adapter into the base weights and write the whole model,
            instead of the adapter alone.
        overwrite: replace an existing `out` that an earlier export wrote (the new folder is complete before
            the old one goes); a folder holding anything else is refused (`check_replaceable`).

    Returns:
        The folder written.

    Raises:
        FileExistsError: `out` exists and `overwrite` is False, or it holds what no export wrote.
        ValueError: the checkpoint is not an `ExGRPOModule`'s (no `model_name_or_path` or no `policy.*`
            weights), or its weights do not fit the model its options name (naming the keys).
        OutOfSpaceError: the disk filled up, naming the file (`out` is as it was).
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(
            f"out={out}: already exists; choose another folder, or overwrite it (--overwrite)"
        )
    check_replaceable(out)
    state_dict, hparams = read_checkpoint(ckpt_path)
    policy = build_policy(state_dict, hparams, ckpt_path, merge_lora)
    name = hparams["model_name_or_path"]
    tokenizer = load_tokenizer(name)
    generation = _generation_config(policy.config, name)
    stop_ids = completion_stop_ids(
        tokenizer, name, hparams.get("stop_token_ids") or (), hparams.get("chat_template", False)
    )
    generation.eos_token_id = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    generation.pad_token_id = tokenizer.pad_token_id

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(str(out.parent))
    temp = Path(temp_path(str(out)))
    try:
        try:
            policy.save_pretrained(temp)  # a PEFT model saves its adapter alone
            tokenizer.save_pretrained(temp)
            generation.save_pretrained(temp)
            _write_manifest(temp, ckpt_path)
        except Exception as err:
            _raise_if_out_of_space(err, temp, out, tensor_bytes(state_dict))
            raise
        check_replaceable(out)  # again: the export took a while, and a run may have started writing there
        _replace(temp, out)
    finally:
        if temp.exists():
            shutil.rmtree(temp)
    return out


def check_replaceable(out: str | os.PathLike) -> None:
    """Raises unless `out` may be replaced by an export: missing, an empty folder, or a folder an earlier
    export wrote (its `MANIFEST` lists every file in it).

    Args:
        out: the export's folder.

    Raises:
        FileExistsError: naming `out` and what in it no export wrote (a run's checkpoints, its logs).
    """
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(
            f"out={out}: a file, not a folder an export wrote; --overwrite replaces only those"
        )
    present = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.is_dir())
    try:
        written = set(json.loads((out / MANIFEST).read_text())["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError, TypeError):
        written = set()
    foreign = [name for name in present if name not in written]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise FileExistsError(
            f"out={out}: holds what no export wrote ({shown}); --overwrite replaces only a folder an earlier "
            f"export wrote (listed in its {MANIFEST}), never a run or other files: choose another folder"
        )


def _write_manifest(folder: Path, ckpt_path) -> None:
    """Lists the files of the finished export in `folder` (`MANIFEST`) and gives every file the mode the
    umask gives a new file: safetensors writes its files 0600, which a server running as another user
    cannot read."""
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    (folder / MANIFEST).write_text(json.dumps({"ckpt_path": str(ckpt_path), "files": files}, indent=1) + "\n")
    mode = 0o666 & ~_umask()
    for name in [*files, MANIFEST]:
        os.chmod(folder / name, mode)


def _umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it: put it straight back
    os.umask(mask)
    return mask


def _raise_if_out_of_space(err: BaseException, temp: Path, out: Path, needed_bytes: int) -> None:
    """`OutOfSpaceError` naming the file being written when `err` says the disk is full: the file an OSError
    names, or for safetensors' own `SafetensorError` (the OS's message in its text, no file) the weights
    file, the newest `*.safetensors` in the temp folder."""
    written = sorted(temp.rglob("*"), key=lambda p: p.stat().st_mtime_ns) if temp.exists() else []
    path = getattr(err, "filename", None) or (written[-1] if written else temp)
    if not isinstance(err, OSError) and ("No space left on device" in str(err) or "StorageFull" in str(err)):
        weights = [p for p in written if p.suffix == ".safetensors"]
        path = weights[-1] if weights else temp / "model.safetensors"
        full = OSError(errno.ENOSPC, "No space left on device")
        full.__cause__ = err
        err = full
    kept = (
        f"Nothing was exported: {out} is as it was (an export is written under this temp name, renamed to "
        "--out once complete; the temp folder is deleted). Free some space, or export elsewhere (--out)."
    )
    raise_if_out_of_space(err, str(path), needed_bytes, kept)


def build_policy(state_dict: dict[str, torch.Tensor], hparams: dict[str, Any], ckpt_path, merge_lora: bool):
    """The policy model the checkpoint's options describe, holding the checkpoint's `policy.*` weights (a PEFT
    model for a LoRA run, unless `merge_lora`)."""
    name = hparams.get("model_name_or_path")
    if name is None:
        raise ValueError(
            f"ckpt_path={ckpt_path}: its hyper_parameters have no model_name_or_path: not a checkpoint of "
            "an ExGRPOModule run (a module of your own: save its policy with save_pretrained)"
        )
    weights = {k[len(POLICY_PREFIX) :]: v for k, v in state_dict.items() if k.startswith(POLICY_PREFIX)}
    if not weights:
        raise ValueError(f"ckpt_path={ckpt_path}: its state_dict has no {POLICY_PREFIX}* weights")
    dtype = DTYPES[hparams.get("dtype", "float32")]
    config = AutoConfig.from_pretrained(resolve_model_path(name))
    # Built from its config, not its weights, which the checkpoint's replace; the name is what a PEFT
    # adapter records as its base model.
    config._name_or_path = resolve_model_path(name)
    policy = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = hparams.get("lora")
    if lora:
        from peft import get_peft_model

        policy = get_peft_model(policy, lora_config(lora))
    missing, unexpected = policy.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"ckpt_path={ckpt_path}: its policy weights do not fit {name!r}"
            f"{' with lora=' + repr(lora) if lora else ''}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    if lora and merge_lora:
        policy = policy.merge_and_unload()
    return policy.eval()


def _generation_config(config, name: str) -> GenerationConfig:
    """The base model's generation config (sampling defaults a chat model ships with), or one from its
    config when it has none."""
    try:
        return GenerationConfig.from_pretrained(resolve_model_path(name))
    except OSError:
        return GenerationConfig.from_model_config(config)


def _replace(temp: Path, out: Path) -> None:
    """Renames the finished `temp` folder to `out`; an existing `out` is renamed away first and deleted after,
    so `out` is always absent, the old folder or the new one."""
    old = Path(temp_path(str(out))) if out.exists() else None
    if old is not None:
        os.replace(out, old)
    os.replace(temp, out)
    if old is not None:
        shutil.rmtree(old)


def main(args: list[str] | None = None) -> None:
    """`exgrpo export`: the command line of `export_policy`."""
    parser = argparse.ArgumentParser(
        prog="exgrpo export", description="Write a checkpoint's policy as a Hugging Face model folder."
    )
    parser.add_argument(
        "--ckpt_path",
        required=True,
        help="a checkpoint file or DeepSpeed checkpoint folder, or `last`: the newest intact one of --root",
    )
    parser.add_argument("--root", default=".", help="with `--ckpt_path last`: the run's default_root_dir")
    parser.add_argument("--out", required=True, help="the folder to write")
    for flag, text in [
        ("--merge_lora", "LoRA: merge the adapter in"),
        ("--overwrite", "replace an existing --out"),
    ]:
        parser.add_argument(flag, type=_boolean, nargs="?", const=True, default=False, help=text)
    options = parser.parse_args(args)
    ckpt_path = last_checkpoint(options.root) if options.ckpt_path == "last" else options.ckpt_path
    out = export_policy(ckpt_path, options.out, options.merge_lora, options.overwrite)
    print(f"Exported the policy of {ckpt_path} to {out}")


def last_checkpoint(root: str | os.PathLike) -> str:
    """What `exgrpo fit --ckpt_path last` would resume from in a run whose `default_root_dir` is `root`: the
    newest complete, intact checkpoint of its logger versions (`lightning_logs/*/checkpoints`) or, logging
    off, of `root/checkpoints`.

    Raises:
        FileNotFoundError: there is none, naming where it looked.
    """
    pattern = os.path.join(glob.escape(str(root)), "lightning_logs", "*", "checkpoints")
    directories = [*sorted(glob.glob(pattern)), os.path.join(str(root), "checkpoints")]
    newest = newest_complete_checkpoint(directories)
    if newest is None:
        raise FileNotFoundError(
            f"ckpt_path=last: no complete, intact checkpoint in {pattern} or {directories[-1]}; give --root "
            "(the run's trainer.default_root_dir) or the checkpoint file itself"
        )
    return newest


def _boolean(value: str) -> bool:
    """'true'/'false' (any case), as LightningCLI reads a bool option."""
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() == "true"

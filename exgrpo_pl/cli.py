"""`exgrpo`: the LightningCLI of exgrpo-pl (fit / validate / test, YAML configs, callbacks by class_path).

exgrpo fit --config configs/quickstart.yaml
exgrpo fit --config configs/quickstart.yaml --print_config
exgrpo fit --config configs/quickstart.yaml --ckpt_path last   # resume from the newest complete checkpoint
exgrpo test --config configs/eval_paper.yaml --ckpt_path X.ckpt # the paper's table of its evaluation sets
exgrpo export --ckpt_path X.ckpt --out DIR                      # the policy as a Hugging Face model folder

A resumed run keeps the options its config files and command line give it, with `--ckpt_path last` as with
a checkpoint file, and warns listing each option whose value differs from the checkpoint's.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from exgrpo_pl.callbacks import DifficultyMonitor, ReplayCallback
from exgrpo_pl.callbacks.monitor import HEATMAP_TAG
from exgrpo_pl.checkpoints.atomic_writes import local_path, write_files_atomically
from exgrpo_pl.checkpoints.export import main as export_main
from exgrpo_pl.checkpoints.requeue import check_requeue, requeued_ckpt_path, slurm_plugins
from exgrpo_pl.checkpoints.saving import AtomicCheckpointIO, SafeModelCheckpoint, check_loadable
from exgrpo_pl.data import PromptDataModule
from exgrpo_pl.evaluation.report import report_files, to_markdown
from exgrpo_pl.lightning_internals import spawns_processes
from exgrpo_pl.module.grpo import ExGRPOModule
from exgrpo_pl.module.validation_curve import CURVE_TAG
from exgrpo_pl.moved import ModuleMovedError, MovedModuleWarning, moved_message, old_paths_in, removed
from exgrpo_pl.renamed import with_renamed_configs
from exgrpo_pl.run_names import free_version, run_name, safe_name


class ExGRPOCLI(LightningCLI):
    """LightningCLI with kill-proof checkpoints by default, that ends a fit by saying where things are.

    Unless the config says otherwise, the trainer writes checkpoints with `AtomicCheckpointIO` (in place of
    Lightning's default `TorchCheckpointIO`; any other CheckpointIO, set as a plugin or on the strategy, is
    kept) and, when no checkpoint callback is configured, saves them with `SafeModelCheckpoint(save_last=
    "link")` (in place of Lightning's default `ModelCheckpoint()`), so a run saves when it ends and
    `--ckpt_path last` finds the previous run's newest complete checkpoint. With no logger configured, it
    logs with Lightning's default `TensorBoardLogger`, less its placeholder `hp_metric` chart and with
    Lightning's `epoch` series as `train/epoch` (`RunLogger`), into a folder named after the run's config
    and seed (`exgrpo-s0`; `--run_name NAME` names it, `exgrpo_pl.run_names`); a fit prints, when it starts
    and when it ends, a TensorBoard link that opens on the run's main charts (`dashboard_link`).

    (The module itself checks the strategy against the trainer in `setup`, so plain `Trainer` runs get the
    same check.) `ddp_spawn` is refused before anything starts (`SPAWN_REFUSED`). Under SLURM, Lightning's
    auto-requeue is off and a requeued job resumes from the newest complete checkpoint
    (`exgrpo_pl.checkpoints.requeue`).

    Resuming, the run's own options stand: LightningCLI would replace the model's options, ones given on the
    command line too, with a checkpoint file's hyperparameters (not for `last`, which it cannot resolve
    before the trainer exists). `ExGRPOModule` warns, when it loads the checkpoint, listing each option whose
    value differs from the checkpoint's (`exgrpo_pl.checkpoints.resume.changed_options`).
    """

    def _parse_ckpt_path(self) -> None:
        # Private: LightningCLI's merge of a checkpoint file's hyperparameters into the parsed config. Left
        # out, so that a file and `last` follow one rule: the config files and the command line decide.
        return

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--run_name",
            type=str | None,
            default=None,
            help="The run's log folder (its name in TensorBoard) under the default logger; default: the "
            "config files' names and the seed, e.g. exgrpo-s0. A name taken gets -v1, -v2, ...",
        )

    def parse_arguments(self, parser, args) -> None:
        args = with_renamed_configs(args)  # configs/exgrpo_seed.yaml -> exgrpo_swap.yaml, with a warning
        check_old_module_paths(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)
        # Before anything is built: loading an empty or truncated file later fails with a bare `torch.load`
        # error that names neither the file nor what is wrong with it.
        subcommand = self.config.get("subcommand")
        check_loadable(self.config[subcommand].get("ckpt_path") if subcommand else None, "--ckpt_path")

    def instantiate_classes(self) -> None:
        """LightningCLI's, with an option error of ours raised alone: jsonargparse wraps an error raised by
        a class it builds (a callback's option out of range, say) in kilobytes of the union types it tried,
        and the one line that names the class, the option and its rule gets lost in the middle."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            cause = own_root_cause(err)
            if cause is None or cause is err:
                raise
            raise type(cause)(str(cause)) from None

    def instantiate_trainer(self, **kwargs) -> Trainer:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_config = config.get("trainer") or {}
        callbacks = kwargs.get("callbacks", trainer_config.get("callbacks")) or []
        callbacks = callbacks if isinstance(callbacks, list) else [callbacks]
        checkpointing = trainer_config.get("enable_checkpointing") is not False
        if checkpointing and not any(isinstance(callback, Checkpoint) for callback in callbacks):
            kwargs["callbacks"] = [*callbacks, SafeModelCheckpoint(save_last="link")]
        if trainer_config.get("logger") in (None, True) and not trainer_config.get("barebones"):
            # Lightning's default logger without its placeholder chart (`hp_metric`, -1 at step 0): the
            # module writes the HParams entry with metrics that compare runs (module/hparams_tab.py).
            root = os.path.normpath(os.path.expanduser(trainer_config.get("default_root_dir") or os.getcwd()))
            name = self._run_name()
            job = SLURMEnvironment.job_id()  # a requeued job logs on in its folder, as Lightning's default
            version = f"{name}-job{job}" if job is not None else None
            kwargs["logger"] = RunLogger(root, version=version, default_hp_metric=False, run_name=name)
        kwargs["plugins"] = slurm_plugins(kwargs.get("plugins", trainer_config.get("plugins")))
        trainer = super().instantiate_trainer(**kwargs)
        check_requeue(trainer)
        if spawns_processes(trainer.strategy):
            raise ValueError(SPAWN_REFUSED)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # Lightning's default, not a user's
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer

    def _run_name(self) -> str:
        """`--run_name`, else the config files' names and the seed (`exgrpo_pl.run_names.run_name`)."""
        parsed = self.config[self.subcommand] if self.subcommand else self.config
        if parsed.get("run_name"):
            return safe_name(parsed["run_name"])
        seed = parsed.get("seed_everything")  # the seed LightningCLI drew for `true`; False: none set
        return run_name(parsed.get("config") or [], None if isinstance(seed, bool) else seed)

    def before_fit(self) -> None:
        # A fit takes minutes to hours: where to watch it, before it starts as well as when it ends. The
        # strategy has not set the ranks yet (every process would be global zero): the launcher's are read.
        if rank_zero_only.rank == 0 and self._dashboard_lines():
            print("\n".join(["", "Training starts.", *self._dashboard_lines()]))
        config = self.config_init[self.subcommand]
        config["ckpt_path"], requeued = requeued_ckpt_path(self.trainer, config.get("ckpt_path"))
        if requeued and rank_zero_only.rank == 0:
            print(requeued)

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines = ["", "Training finished.", *self._dashboard_lines()]
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None:
            path = checkpoint.best_model_path or checkpoint.last_model_path
            if path:
                lines.append(f"  checkpoint:  {path}")
        print("\n".join(lines))

    def _dashboard_lines(self) -> list[str]:
        """Where the logs are, the command that shows them, and (TensorBoard) the link to open."""
        logger = self.trainer.logger
        if logger is None or not logger.log_dir:
            return []
        root = getattr(logger, "root_dir", logger.save_dir)
        lines = [f"  logs:        {logger.log_dir}", f"  dashboards:  tensorboard --logdir {root}"]
        if isinstance(logger, TensorBoardLogger):
            link = dashboard_link(os.path.relpath(logger.log_dir, root), self.trainer.callbacks)
            lines.append(f"               then open {link}")
        return lines

    def after_validate(self) -> None:
        self._report("validation")

    def after_test(self) -> None:
        self._report("test")

    def _report(self, name: str) -> None:
        """Prints the named evaluation sets' table and writes it as JSON and Markdown next to the logs."""
        table = getattr(self.model, "last_evaluation_table", None)
        if table is None or not self.trainer.is_global_zero:
            return
        print("\n" + to_markdown(table))
        logger = self.trainer.logger
        directory = logger.log_dir if logger is not None and logger.log_dir else self.trainer.default_root_dir
        files = report_files(table, directory, name)
        write_files_atomically(files)  # both or neither: a full disk leaves the previous run's pair whole
        json_path, markdown_path = files
        print(f"  table:       {json_path}\n               {markdown_path}")


SPAWN_REFUSED = (
    "trainer.strategy: ddp_spawn (a strategy that starts its processes by pickling the trainer, model and"
    " data into new interpreters) is not supported by exgrpo; use `--trainer.strategy ddp`, which starts"
    " one process per device running the same command (or launch with torchrun or srun:"
    " docs/several-nodes.md)."
)


class RunLogger(TensorBoardLogger):
    """Lightning's `TensorBoardLogger` (same arguments) that writes Lightning's `epoch` series as
    `train/epoch`, the tag TRL's runs give it, and, given `run_name`, names the run's folder after it.

    TensorBoard's Time Series page opens only its first two groups of charts (tags grouped by their part
    before the first `/`, groups sorted by name): a flat `epoch` chart would take one of the two.

    Args:
        run_name: without a `version`, the run's folder: `run_name`, or `run_name-v1`, `-v2`, ... when
            taken (`exgrpo_pl.run_names.free_version`); None: Lightning's `version_N`.
    """

    def __init__(self, *args: Any, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_name = run_name

    def _get_next_version(self) -> int | str:
        # Lightning's hook for a logger given no version, asked once, lazily, on every rank.
        if self.run_name is None:
            return super()._get_next_version()
        return free_version(self.root_dir, self.run_name)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if "epoch" in metrics:
            metrics = {("train/epoch" if name == "epoch" else name): value for name, value in metrics.items()}
        super().log_metrics(metrics, step)


# The charts the dashboard link pins: the validation curve, the reward, and the share of each update that
# replayed rows drive (what replay does to the batch, not how much of it the configuration hands over).
PINNED_SCALARS = ("val/pass@1", "train/reward")
PINNED_REPLAY = "train/replayed_share"


def dashboard_link(run: str, callbacks: list[Any], port: int = 6006) -> str:
    """A link to `tensorboard --logdir ROOT`'s page (at its default port) that opens with the validation
    curve (the chart that compares runs, and `run`'s picture of it, with its values written), the reward
    and, where the run has them, the replayed rows' share of the update and the latest heatmap of `run`
    (its folder under ROOT) pinned above every group: TensorBoard reads the pins from the link's
    `pinnedCards`, while its plain page opens only the first two groups of charts by name, 12 charts each;
    and with no smoothing (the link's `smoothing=0`), so that each chart's line is its logged values."""
    # An image card belongs to one run; TensorBoard names a run of its only experiment so.
    run_id = f"defaultExperimentId/{Path(run).as_posix()}"
    curve = {"plugin": "images", "tag": CURVE_TAG, "runId": run_id, "sample": 0}
    cards: list[dict[str, Any]] = [{"plugin": "scalars", "tag": PINNED_SCALARS[0]}, curve]
    cards += [{"plugin": "scalars", "tag": tag} for tag in PINNED_SCALARS[1:]]
    if any(isinstance(callback, ReplayCallback) for callback in callbacks):
        cards.append({"plugin": "scalars", "tag": PINNED_REPLAY})
    if any(isinstance(callback, DifficultyMonitor) for callback in callbacks):
        cards.append({"plugin": "images", "tag": HEATMAP_TAG, "runId": run_id, "sample": 0})
    pins = quote(json.dumps(cards, separators=(",", ":")), safe="")
    # Smoothing 0: TensorBoard's default 0.6 draws a 7-point validation curve far from its own values.
    return f"http://localhost:{port}/?pinnedCards={pins}&smoothing=0#timeseries"


class AtomicSaveConfigCallback(SaveConfigCallback):
    """Lightning's `SaveConfigCallback` (same arguments), writing a local config file with
    `write_files_atomically`: Lightning's writer opens the file for writing, which empties it, so with
    `overwrite=True` (as `exgrpo` runs) a full disk or a kill would leave a resumed run's config.yaml cut
    short; here it is the old file or the new one. `multifile=True` and remote paths keep Lightning's writer.
    """

    def __init__(self, parser, config, *args, **kwargs) -> None:
        super().__init__(_AtomicSave(parser), config, *args, **kwargs)


class _AtomicSave:
    """The CLI's parser, whose `save` of one local file writes it atomically (else the parser's own)."""

    def __init__(self, parser) -> None:
        self._parser = parser

    def __getattr__(self, name: str):
        return getattr(self._parser, name)

    def save(self, config, path, *, overwrite: bool = False, multifile: bool = False, **dump_options) -> None:
        local = local_path(path)
        if multifile or local is None:
            self._parser.save(config, path, overwrite=overwrite, multifile=multifile, **dump_options)
            return
        # SaveConfigCallback has refused an existing file already unless `overwrite` allows it.
        write_files_atomically({local: self._parser.dump(config, **dump_options)})


def _own_code() -> tuple[Path, Path]:
    """The folders this package's code runs from: the package, and its callbacks wherever they are installed
    from (a checkout's `callbacks/` folder in an editable install)."""
    import exgrpo_pl.callbacks

    return Path(__file__).parent, Path(exgrpo_pl.callbacks.__file__).parent


def own_root_cause(err: BaseException) -> BaseException | None:
    """The first exception `err` was raised from or during, `err` included, that was raised by this
    package's code (the innermost frame of its traceback is in it), or None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        frames = err.__traceback__
        while frames is not None and frames.tb_next is not None:
            frames = frames.tb_next
        origin = Path(frames.tb_frame.f_code.co_filename) if frames is not None else None
        if origin is not None and any(origin.is_relative_to(folder) for folder in _own_code()):
            return err
        err = err.__cause__ or err.__context__
    return None


def check_old_module_paths(args) -> None:
    """Before parsing: when a config file or an argument names a module of the flat layout
    (`exgrpo_pl.moved`), one `MovedModuleWarning` listing the file and line (or the argument), the old path
    and the new one; `ModuleMovedError` with the same list once the old paths are removed.

    jsonargparse would report a removed path too, but only the first one, inside the dump of every type it
    tried (as for `instantiate_classes`' errors); and the stand-in modules' own warnings would name only the
    module, so they are not repeated here. A config file is any argument naming a UTF-8 text file of at most
    1 MiB, whatever its suffix (`--config run.cfg`, `--trainer=trainer.txt`); YAML comments are not read.
    """
    found = []
    for source, text in _argument_texts(args):
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{source}, line {number}" if source != "argument" else f"argument {line!r}"
            code = "" if line.lstrip().startswith("#") else line.split(" #")[0]
            found += [(f"{where}: {dotted}: {moved_message(old)}", old) for dotted, old in old_paths_in(code)]
    if not found:
        return
    lines = [f"  {line}" for line, _ in found]
    if removed():
        header = "exgrpo_pl's modules moved into folders; update these paths:"
        raise ModuleMovedError(found[0][1], "\n".join([header, *lines]))
    header = "exgrpo_pl's modules moved into folders; these old paths still work, with a warning:"
    warnings.warn("\n".join([header, *lines]), MovedModuleWarning, stacklevel=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MovedModuleWarning)
        for old in dict.fromkeys(old for _, old in found):
            importlib.import_module(old)


def _argument_texts(args) -> Iterator[tuple[str, str]]:
    """(source, text) of each argument: the contents of a config file it names, or the argument itself."""
    for arg in map(str, args if isinstance(args, list | tuple) else [args]):  # a dict: its text
        path = Path(arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg)
        try:  # a config is small text: a large data file or a checkpoint is not read
            text = path.read_bytes().decode() if path.is_file() and path.stat().st_size <= 2**20 else None
        except (OSError, UnicodeDecodeError):  # not a path (a name too long, ...), unreadable, or binary
            text = None
        yield (str(path), text) if text is not None else ("argument", arg)


DESCRIPTION = "exgrpo-pl: GRPO with selective experience replay (ExGRPO), on Lightning's Trainer."
# `export` is not a Trainer method, so it is dispatched before LightningCLI and missing from its subcommands.
EXPORT_HINT = (
    "One more subcommand: `exgrpo export --ckpt_path X.ckpt --out DIR` writes a checkpoint's policy as a "
    "Hugging Face model folder (`exgrpo export --help`)."
)


def main(args=None) -> None:
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list | tuple) and list(argv[:1]) == ["export"]:  # not a Trainer subcommand
        export_main(list(argv[1:]))
        return
    ExGRPOCLI(
        ExGRPOModule,
        PromptDataModule,
        save_config_callback=AtomicSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        parser_kwargs={"description": DESCRIPTION, "epilog": EXPORT_HINT},
        args=args,
    )


if __name__ == "__main__":
    main()

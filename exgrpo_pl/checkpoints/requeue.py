"""Resuming on a cluster: a SLURM requeue that resumes only from a complete checkpoint, and ranks that must
all resume from the same one.

Under SLURM, Lightning turns its auto-requeue on by default: on the requeue signal (`--signal=USR1@90`) its
signal handler writes `hpc_ckpt_N.ckpt` in the middle of whatever the process was doing (a step half
done: its batch drawn, the generators advanced), and the requeued job's same command loads that file without
a word when no `--ckpt_path` is given, and does not continue the run exactly. `exgrpo fit` therefore:

- builds the trainer with `SLURMEnvironment(auto_requeue=False)` (`slurm_plugins`), so nothing is saved from a
  signal handler, and refuses a configured `SLURMEnvironment` whose `auto_requeue` is on (`check_requeue`);
- resumes a requeued job (`SLURM_RESTART_COUNT` > 0) given no `--ckpt_path` from the newest complete
  checkpoint, `--ckpt_path last`, and says which (`requeued_ckpt_path`); the sbatch script requeues the job
  (examples/slurm/exgrpo.sbatch, docs/several-nodes.md);
- refuses to start under SLURM with no `--ckpt_path` while an `hpc_ckpt_*.ckpt` lies in the root folder, which
  Lightning would load silently.

`check_same_resume` (called by `SafeModelCheckpoint.setup`) stops every rank at once when ranks resolved
`ckpt_path="last"` to different checkpoints, or one of them to none: nodes that do not share the checkpoint
folder would otherwise resume from different steps and hang in their first collective.
"""

from __future__ import annotations

import glob
import os
import socket
from typing import Any

import torch.distributed as dist
from lightning.pytorch.plugins.environments import ClusterEnvironment, SLURMEnvironment

from exgrpo_pl.lightning_internals import cluster_environment

HPC_PATTERN = "hpc_ckpt_*.ckpt"  # Lightning's name for the checkpoints its requeue handler writes
SHARED_FOLDER_FIX = (
    "Every node must see the same checkpoint folder: put trainer.default_root_dir (or the checkpoint"
    " callback's dirpath) on a filesystem shared by all nodes (docs/several-nodes.md)."
)


def slurm_plugins(plugins: Any) -> Any:
    """The trainer's `plugins` with `SLURMEnvironment(auto_requeue=False)` added when running under SLURM
    and no cluster environment is configured; otherwise `plugins` unchanged.

    Args:
        plugins: the trainer's `plugins` option (None, one plugin or a list).
    """
    if not SLURMEnvironment.detect():
        return plugins
    given = [] if plugins is None else plugins if isinstance(plugins, list) else [plugins]
    if any(isinstance(plugin, ClusterEnvironment) for plugin in given):
        return plugins
    return [*given, SLURMEnvironment(auto_requeue=False)]


def check_requeue(trainer) -> None:
    """Raises ValueError when the trainer's cluster environment is a `SLURMEnvironment` with auto-requeue on,
    whose signal handler saves mid-step checkpoints.

    Args:
        trainer: the constructed trainer.
    """
    environment = cluster_environment(trainer)
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        raise ValueError(
            "trainer.plugins: SLURMEnvironment(auto_requeue=True) saves a checkpoint from its signal handler"
            " in the middle of a training step, and a requeued job would resume from that state, not"
            " continuing the run exactly. Set auto_requeue: false (or remove the plugin: exgrpo sets it so"
            " under SLURM) and requeue from the sbatch script (examples/slurm/exgrpo.sbatch); the requeued"
            " job resumes from the newest complete checkpoint."
        )


def requeued_ckpt_path(trainer, ckpt_path: Any) -> tuple[Any, str | None]:
    """The `ckpt_path` a fit under SLURM should use, and a message to print (or None).

    A requeued job (`SLURM_RESTART_COUNT` > 0) given no `ckpt_path` resumes with "last", the newest complete
    checkpoint, which the message names. Any other run keeps `ckpt_path`.

    Args:
        trainer: the constructed trainer (its checkpoint callback finds "last").
        ckpt_path: the `--ckpt_path` given, or None.

    Raises:
        ValueError: under SLURM with no `ckpt_path`, when an `hpc_ckpt_*.ckpt` lies in the trainer's root
            folder (Lightning would resume from it silently).
    """
    if ckpt_path is not None or not SLURMEnvironment.detect():
        return ckpt_path, None
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if restarts == 0:
        hpc = sorted(glob.glob(os.path.join(glob.escape(str(trainer.default_root_dir)), HPC_PATTERN)))
        if hpc:
            raise ValueError(
                f"{hpc[-1]}: Lightning's auto-requeue wrote it in the middle of a training step, and a run"
                " without --ckpt_path would resume from it silently, not continuing the run exactly. Remove"
                " it, or resume from a complete checkpoint with --ckpt_path last."
            )
        return None, None
    callback = trainer.checkpoint_callback
    finder = getattr(callback, "find_last_checkpoints", None)
    found = sorted(finder(trainer) or []) if finder is not None else []
    job = SLURMEnvironment.job_id()
    if finder is None:
        where = "from the newest complete checkpoint (--ckpt_path last)"
    elif found:
        where = f"from {found[0]}, the newest complete checkpoint"
    else:
        where = "from the beginning: no complete checkpoint was found"
    return "last", f"SLURM requeued job {job} (restart {restarts}) with no --ckpt_path: resuming {where}."


def check_same_resume(resolved: str | None, directories: list[str] | None) -> None:
    """Raises RuntimeError on every rank when the ranks resolved `ckpt_path="last"` to different checkpoints
    (or some to none), naming each rank's host and checkpoint. Every rank must call it (it all-gathers).

    Args:
        resolved: the checkpoint this rank resolved "last" to, or None.
        directories: where this rank looked, for the message.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    own = (socket.gethostname(), resolved, directories)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    if len({path for _, path, _ in gathered}) == 1:
        return
    lines = [
        f"rank {rank} on {host}: {path}" if path else f"rank {rank} on {host}: none found in {looked}"
        for rank, (host, path, looked) in enumerate(gathered)
    ]
    raise RuntimeError(
        'ckpt_path="last": the ranks would resume from different checkpoints:\n  '
        + "\n  ".join(lines)
        + f"\n{SHARED_FOLDER_FIX}"
    )

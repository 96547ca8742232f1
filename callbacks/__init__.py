"""Lightning callbacks of exgrpo-pl, installed as `exgrpo_pl.callbacks`.

- `replay`: `ReplayCallback`, which turns a GRPO LightningModule into ExGRPO, with its checks
  (`replay_checks`, and `module_checks` on what a module of one's own hands over), its rescoring of stored
  trajectories (`rescoring`) and how its ranks agree (`collectives`).
- `monitor`: `DifficultyMonitor`, the replay buffer drawn in TensorBoard.
- `export`: `ExportPolicy`, the trained policy as a Hugging Face model folder when training ends.

Layer: above the module (`exgrpo_pl.module`: its logging steps and strategy helpers), the replay memory
(`exgrpo_pl.experience`) and the shared basics (the replay contract, `exgrpo_pl.contract`), which they
import; only the CLI (`exgrpo_pl.cli`) is above them.
"""

from exgrpo_pl.callbacks.export import ExportPolicy
from exgrpo_pl.callbacks.monitor import DifficultyMonitor
from exgrpo_pl.callbacks.replay import ReplayCallback

__all__ = ["DifficultyMonitor", "ExportPolicy", "ReplayCallback"]

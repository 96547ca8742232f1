"""Lightning callbacks of exgrpo-pl, installed as `exgrpo_pl.callbacks`."""

from exgrpo_pl.callbacks.monitor import DifficultyMonitor
from exgrpo_pl.callbacks.replay import ReplayCallback

__all__ = ["DifficultyMonitor", "ReplayCallback"]

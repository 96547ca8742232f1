"""The validation curve as a picture for TensorBoard: `val/pass@1` of every validation of the run so far,
each point's value written beside it, on a y-axis that holds them all.

TensorBoard's own chart of `val/pass@1` scales its y-axis, by default ("Ignore outliers in chart scaling",
which no link can turn off), to the points between the 5th and 95th percentile: on a curve of up to 21
points that leaves out the highest, so the last, best points of a rising validation curve can run off the
top of its card. This picture shows them whatever the reader's settings. `draw_curve` renders with matplotlib
(the `viz` extra), imported when called; without it no picture is logged.
"""

from __future__ import annotations

import numpy as np
from lightning.pytorch.loggers import TensorBoardLogger

CURVE_TAG = "val/pass@1_curve"
CURVE_SIZE = (6.4, 3.6)  # inches, at CURVE_DPI: 640 x 360 pixels
CURVE_DPI = 100
LABELLED_POINTS = 12  # up to this many points each get their value written; more: the first, best and last


def curve_limits(values: list[float]) -> tuple[float, float]:
    """The y-axis range of the picture: every value inside it, with a margin for the written values."""
    low, high = min(values), max(values)
    margin = max(0.02, 0.12 * (high - low))
    return low - margin, high + margin


def labelled(values: list[float]) -> list[int]:
    """Indices of the points whose value is written: all of up to `LABELLED_POINTS`, else the first, the
    (first) best and the last."""
    if len(values) <= LABELLED_POINTS:
        return list(range(len(values)))
    return sorted({0, int(np.argmax(values)), len(values) - 1})


def draw_curve(points: list[tuple[int, float]], name: str) -> np.ndarray:
    """`[H, W, 3]` uint8 picture of the curve `points` ((step, value) pairs in step order) of metric `name`,
    the best point marked and named in the title. Raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [step for step, _ in points]
    values = [value for _, value in points]
    best = int(np.argmax(values))
    figure = Figure(figsize=CURVE_SIZE, dpi=CURVE_DPI)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(steps, values, marker="o", color="tab:blue")
    axes.plot([steps[best]], [values[best]], marker="*", markersize=14, color="tab:orange", linestyle="")
    for index in labelled(values):
        axes.annotate(
            f"{values[index]:.3f}", (steps[index], values[index]), textcoords="offset points", xytext=(0, 7),
            ha="center", fontsize=10,
        )  # fmt: skip
    axes.set_ylim(*curve_limits(values))
    axes.set_xlabel("step")
    axes.set_title(
        f"{name}: {values[-1]:.3f} at step {steps[-1]}, best {values[best]:.3f} at step {steps[best]}",
        fontsize=11,
    )
    axes.grid(alpha=0.3)
    figure.tight_layout()
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def log_curve(trainer, points: list[tuple[int, float]], step: int) -> None:
    """Writes the picture of `points` (`val/pass@1`) as `CURVE_TAG` at `step` to the trainer's TensorBoard
    loggers, on global rank 0; nothing without one, without points or without matplotlib."""
    loggers = [lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)]
    if not (loggers and points and trainer.is_global_zero):
        return
    try:
        image = draw_curve(points, "val/pass@1")
    except ImportError:  # the DifficultyMonitor says once how to add matplotlib; the scalar chart remains
        return
    for logger in loggers:
        logger.experiment.add_image(CURVE_TAG, image, step, dataformats="HWC")

"""A rich progress bar with ETA, on rank 0."""

from __future__ import annotations

from typing import Any

from skylift.loop.events import Callback, TrainState
from skylift.monitor.metrics import MetricsLogger

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """Shows steps done, ETA, and the last logged loss and throughput.

    It reads figures the :class:`MetricsLogger` already materialised, so it never
    forces a device synchronisation of its own.
    """

    def __init__(self, metrics: MetricsLogger) -> None:
        self.metrics = metrics
        self._progress: Any = None
        self._task: Any = None

    def on_fit_start(self, state: TrainState) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[throughput]} samples/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self._task = self._progress.add_task(
            "train", total=state.total_steps, completed=state.step, epoch=state.epoch, loss="-", throughput="-"
        )
        self._progress.start()

    def on_step_end(self, state: TrainState) -> None:
        logged = self.metrics.last_logged
        fields: dict[str, Any] = {"epoch": state.epoch}
        if "loss" in logged:
            fields.update(loss=f"{logged['loss']:.4f}", throughput=f"{logged['samples_per_s']:.0f}")
        self._progress.update(self._task, completed=state.step, **fields)

    def on_fit_end(self, state: TrainState) -> None:
        if self._progress is not None:
            self._progress.stop()

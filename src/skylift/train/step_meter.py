"""What one optimizer step of a hand-written loop took: its time, data wait, samples, FLOPs.

The measuring half of the runtime's survive-and-watch part: it changes with what the
monitor reports, not with how gradients are computed or where the model runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from skylift.train.prepared_loader import batch_size_of

__all__ = ["StepMeasures", "StepMeter"]


@dataclass(frozen=True)
class StepMeasures:
    samples: int
    """Samples this rank's micro-batches of the step held."""
    data_wait_s: float
    step_time_s: float
    """From the step's first fetch or forward to its end (0.0 when it never opened)."""


class StepMeter:
    """Times each step from its first fetch (or forward) and counts the FLOPs of the first
    micro-step, for MFU in a loop whose loss skylift does not know."""

    def __init__(self) -> None:
        self._open = False
        self._started = 0.0
        self._samples = 0
        self._data_wait_s = 0.0
        self._micro_batch_samples = 0
        self._flop_counter: Any = None

    def begin(self, clock: Any, micro_step: int) -> None:
        """Open the step on the first micro-step's first call; later calls do nothing."""
        if self._open or micro_step != 0:
            return
        self._open = True
        self._started = time.perf_counter()
        if clock is not None:
            clock.mark("between_steps")

    def next_batch(self, batches: Iterator[Any], clock: Any) -> Any:
        """The next batch of ``batches``, its wait timed as data wait and its samples counted."""
        before = time.perf_counter()
        batch = next(batches)
        self._data_wait_s += time.perf_counter() - before
        if clock is not None:
            clock.mark("data_wait")
        self._micro_batch_samples = batch_size_of(batch)
        self._samples += self._micro_batch_samples
        return batch

    def end(self) -> StepMeasures:
        """The step's measures; the next call to :meth:`begin` opens a new step."""
        step_time_s = time.perf_counter() - self._started if self._open else 0.0
        measures = StepMeasures(self._samples, self._data_wait_s, step_time_s)
        self._open, self._samples, self._data_wait_s = False, 0, 0.0
        return measures

    def start_flop_count(self, monitor: Any) -> None:
        """Count the FLOPs of the first micro-step as it runs (forward here, backward until
        :meth:`finish_flop_count`), when ``monitor`` wants them."""
        if monitor is None or not monitor.wants_flops or self._flop_counter is not None:
            return
        from torch.utils.flop_counter import FlopCounterMode

        self._flop_counter = FlopCounterMode(display=False)
        self._flop_counter.__enter__()

    def finish_flop_count(self, monitor: Any) -> None:
        counter, self._flop_counter = self._flop_counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)
        monitor.record_flops(float(counter.get_total_flops()), self._micro_batch_samples)

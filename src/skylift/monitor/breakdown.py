"""Where a step's time goes: data wait, host-to-device copy, forward+backward,
exposed gradient communication, optimizer, checkpoint stall, and the rest.

Only every ``monitor.breakdown_every_steps``-th step is measured. A measured step's
window runs from the end of the previous step to the end of its own (``step_end``), so
time spent between steps (callbacks, the checkpoint launch, the stop agreement) and
after the optimizer update (the loss kept for logging, an EMA update) is counted too,
as "other": the window holds the step's whole ``step_time_s``. Phase boundaries are marks: wall-clock timestamps on a
CPU, CUDA events on a GPU, read once the step's last event has completed. On a GPU
the event gaps are the *device's* timeline, so "data wait" is the time the GPU sat
idle for input, not the time the host spent fetching while the GPU was still busy.

Gradient communication hides behind backward in DDP; only the part that does not
is a cost. It comes from DDP's own reducer timers (``_get_ddp_logging_data``):
exposed = communication end - backward compute end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from skylift.monitor.schema import BREAKDOWN_PHASES

__all__ = ["StepClock"]


class _Marks:
    """Timestamps of phase boundaries for one step."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self.names: list[str] = []
        self.marks: list[Any] = []

    def mark(self, name: str) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        self.names.append(name)

    def durations_s(self) -> dict[str, float]:
        """Seconds between consecutive marks, keyed by the name of the later mark."""
        if self._cuda:
            self.marks[-1].synchronize()
            gaps = [start.elapsed_time(end) / 1e3 for start, end in zip(self.marks, self.marks[1:], strict=False)]
        else:
            gaps = [end - start for start, end in zip(self.marks, self.marks[1:], strict=False)]
        totals: dict[str, float] = {}
        for name, gap in zip(self.names[1:], gaps, strict=True):
            totals[name] = totals.get(name, 0.0) + max(gap, 0.0)
        return totals


class StepClock:
    """Marks phase boundaries on sampled steps and turns them into a breakdown.

    Args:
        every_steps: measure steps whose number is a multiple of this (0: never).
        device: where the model runs (CUDA events there, wall clock elsewhere).
        checkpoint_stall_s: cumulative seconds the training thread spent in
            checkpoint saves and waits (from the checkpointing session), split as
            ``(between steps, inside the optimizer step)``.
        ddp_module: returns the DDP wrapper when training with DDP, else ``None``.
        micro_steps: forward passes per optimizer step (gradient accumulation).
    """

    def __init__(
        self,
        every_steps: int,
        device: torch.device,
        *,
        checkpoint_stall_s: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0),
        ddp_module: Callable[[], Any] = lambda: None,
        micro_steps: int = 1,
    ) -> None:
        self.every_steps = every_steps
        self.micro_steps = micro_steps
        """Forward passes per optimizer step (the Trainer may settle it after construction)."""
        self._device = device
        self._stall_s = checkpoint_stall_s
        self._ddp_module = ddp_module
        self._window_started: Any = None
        self._marks: _Marks | None = None
        self._stall_at_start = (0.0, 0.0)
        self._last_comm_end_ns: int | None = None
        self._ddp_rate_set = False

    def will_measure(self, step: int) -> bool:
        """Whether step number ``step`` (1-based) is measured."""
        return self.every_steps > 0 and step % self.every_steps == 0

    def end_of_previous_step(self, next_step: int) -> None:
        """Mark where the next step's window opens (the previous step just finished)."""
        self._marks = None
        if not self.will_measure(next_step):
            return
        self._arm_ddp_timers()
        self._marks = _Marks(self._device)
        self._marks.mark("start")
        self._stall_at_start = self._stall_s()

    def mark(self, phase: str) -> None:
        """The phase named ``phase`` ends now (``between_steps``, ``data_wait``, ...)."""
        if self._marks is not None:
            self._marks.mark(phase)

    def finish(self) -> dict[str, float] | None:
        """The breakdown of the step that just ended, or ``None`` if it was not measured."""
        marks, self._marks = self._marks, None
        if marks is None:
            return None
        marks.mark("after_optimizer")  # the step's end: what ran after the update is its time too
        spans = marks.durations_s()
        between_stall, optimizer_stall = (
            now - before for now, before in zip(self._stall_s(), self._stall_at_start, strict=True)
        )
        communication_s = self._exposed_communication_s()
        forward_backward_s = spans.get("forward_backward", 0.0)
        breakdown = {
            "data_wait": spans.get("data_wait", 0.0),
            "host_to_device": spans.get("host_to_device", 0.0),
            "forward_backward": max(forward_backward_s - communication_s, 0.0),
            "communication": min(communication_s, forward_backward_s),
            "optimizer": max(spans.get("optimizer", 0.0) - optimizer_stall, 0.0),
            "checkpoint": between_stall + optimizer_stall,
            "other": max(spans.get("between_steps", 0.0) + spans.get("after_optimizer", 0.0) - between_stall, 0.0),
        }
        return {phase: round(breakdown[phase], 6) for phase in BREAKDOWN_PHASES}

    def _arm_ddp_timers(self) -> None:
        ddp = self._ddp_module()
        if ddp is None or self._ddp_rate_set:
            return
        # The reducer times its first 10 forward passes and then every N-th (counted
        # from 1); N = forwards per sampling period lands on the last micro-step of a
        # measured step, the one that communicates, and keeps timing off the others.
        setter = getattr(ddp, "_set_ddp_runtime_logging_sample_rate", None)
        if setter is not None:
            setter(max(self.every_steps * self.micro_steps, 1))
        self._ddp_rate_set = True

    def _exposed_communication_s(self) -> float:
        ddp = self._ddp_module()
        getter = getattr(ddp, "_get_ddp_logging_data", None) if ddp is not None else None
        if getter is None:
            return 0.0
        data = getter()
        comm_end_ns = data.get("backward_comm_time_end")
        compute_end_ns = data.get("backward_compute_time_end")
        if not comm_end_ns or not compute_end_ns or comm_end_ns == self._last_comm_end_ns:
            return 0.0  # no fresh reducer sample for this step
        self._last_comm_end_ns = comm_end_ns
        return max(comm_end_ns - compute_end_ns, 0) / 1e9

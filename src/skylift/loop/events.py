"""The training loop's named events, and the state callbacks see.

The loop, drawn once (every name in capitals is an :class:`Event`)::

    FIT_START
    for epoch in epochs:
        EPOCH_START
        for step in the epoch's remaining global batches:
            STEP_START
            for micro_step in accumulation.steps:
                batch = next(loader)                  # time spent here: data wait
                with runtime.autocast(): loss = recipe.training_loss(model, batch)
                runtime.backward(loss)
            runtime.optimizer_step()                  # unscale, clip, step, LR schedule
            STEP_END                                  # metrics, progress, checkpoint policy
            if a stop was requested: PREEMPTION_NOTICE, leave both loops
        if epoch is an eval epoch: evaluate -> EVAL_END
        EPOCH_END
    CHECKPOINT (final model written)
    FIT_END

Callbacks subscribe to the events they need (metrics, progress bar, monitoring,
checkpointing) instead of being hard-wired into the loop.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Callback", "Event", "EventBus", "TrainState"]


class Event(str, enum.Enum):
    """Points in the loop where callbacks run; see the module docstring for the order."""

    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    STEP_START = "step_start"
    STEP_END = "step_end"
    EVAL_END = "eval_end"
    EPOCH_END = "epoch_end"
    CHECKPOINT = "checkpoint"
    PREEMPTION_NOTICE = "preemption_notice"
    FIT_END = "fit_end"


@dataclass
class TrainState:
    """What the loop knows; callbacks read it and must not change the counters."""

    total_steps: int
    steps_per_epoch: int
    global_batch_size: int
    step: int = 0
    """Optimizer steps completed."""
    epoch: int = 0
    """Current epoch (0-based)."""
    samples_seen: int = 0
    """Training samples consumed across all ranks."""
    loss: torch.Tensor | None = None
    """Mean loss of the last optimizer step, still on the device."""
    grad_norm: torch.Tensor | None = None
    """Global gradient norm before clipping of the last step (when clipping is on)."""
    lr: float = 0.0
    step_time_s: float = 0.0
    """Wall time of the last optimizer step, data wait included."""
    data_wait_s: float = 0.0
    """Time the last step spent waiting for batches."""
    eval_metrics: dict[str, float] = field(default_factory=dict)
    stop_requested: str | None = None
    """Set to a reason to end the run at the next step boundary."""
    extra: dict[str, Any] = field(default_factory=dict)


class Callback:
    """Base class: override ``on_<event value>`` methods, e.g. ``on_step_end(state)``."""

    def events(self) -> dict[Event, Callable[[TrainState], None]]:
        handlers = {}
        for event in Event:
            handler = getattr(self, f"on_{event.value}", None)
            if handler is not None:
                handlers[event] = handler
        return handlers


class EventBus:
    """Calls subscribers in registration order."""

    def __init__(self) -> None:
        self._handlers: dict[Event, list[Callable[[TrainState], None]]] = defaultdict(list)

    def subscribe(self, event: Event, handler: Callable[[TrainState], None]) -> None:
        self._handlers[event].append(handler)

    def add(self, callback: Callback) -> None:
        for event, handler in callback.events().items():
            self.subscribe(event, handler)

    def fire(self, event: Event, state: TrainState) -> None:
        for handler in self._handlers.get(event, ()):
            handler(state)

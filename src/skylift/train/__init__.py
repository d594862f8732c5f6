"""Train: the runtime for hand-written loops, the Trainer, precision and DDP."""

from skylift.train.events import Callback, Event, TrainState
from skylift.train.runtime import Runtime
from skylift.train.trainer import RunSummary, Trainer

__all__ = ["Callback", "Event", "RunSummary", "Runtime", "TrainState", "Trainer"]

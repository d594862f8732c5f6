"""Train: the runtime for hand-written loops, the Trainer, precision and DDP.

Imported lazily: the parts below the Trainer (``events``, ``distributed``) are shared
primitives that the monitor and checkpoint packages import, and must not pull the
Trainer (and through it those same packages) in with them.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Callback", "Event", "RunSummary", "Runtime", "TrainState", "Trainer"]

_LAZY = {
    "Callback": "skylift.train.events",
    "Event": "skylift.train.events",
    "TrainState": "skylift.train.events",
    "Runtime": "skylift.train.runtime",
    "RunSummary": "skylift.train.trainer",
    "Trainer": "skylift.train.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'skylift.train' has no attribute {name!r}")

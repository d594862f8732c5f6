"""Train: the runtime for hand-written loops, the Trainer, precision and DDP.

Imported lazily, so ``import skylift.train`` costs nothing until a name is used; the
loop's primitives (events, the process group, the ranks' agreement) live below it in
:mod:`skylift.loop`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Callback", "Event", "RunSummary", "Runtime", "TrainState", "Trainer"]

_LAZY = {
    "Callback": "skylift.loop.events",
    "Event": "skylift.loop.events",
    "TrainState": "skylift.loop.events",
    "Runtime": "skylift.train.runtime",
    "RunSummary": "skylift.train.trainer",
    "Trainer": "skylift.train.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'skylift.train' has no attribute {name!r}")

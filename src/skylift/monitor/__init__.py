"""Watch: metrics, system sampling, step-time breakdown, MFU, cost, diagnosis and reports.

Submodules are imported on first use, so ``skylift report`` and ``skylift monitor``
start without loading the training stack.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["MetricsLogger", "ProgressBar"]

_LAZY = {"MetricsLogger": "skylift.monitor.metrics", "ProgressBar": "skylift.monitor.progress"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'skylift.monitor' has no attribute {name!r}")

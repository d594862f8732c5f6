"""Data: datasets, rank-aware samplers and loaders.

Imported lazily, so a torch-free module of it (``skylift.data.shards``, which ``skylift
check`` reads a dataset's index with) costs no torch import.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GlobalBatchSampler", "ShardedEvalSampler", "TokenBudgetBatchSampler"]

_LAZY = {
    "GlobalBatchSampler": "skylift.data.sampler",
    "ShardedEvalSampler": "skylift.data.sampler",
    "TokenBudgetBatchSampler": "skylift.data.token_budget",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'skylift.data' has no attribute {name!r}")

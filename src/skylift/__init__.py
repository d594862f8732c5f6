"""skylift: take a PyTorch training job to cloud GPUs, fast, cheap and preemption-proof.

The package imports lazily, so ``import skylift`` and ``skylift --help`` stay fast;
``skylift.Trainer`` and friends load torch on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["RunConfig", "Runtime", "Trainer", "__version__", "load_config"]

_LAZY = {
    "RunConfig": "skylift.config.schema",
    "load_config": "skylift.config.load",
    "Runtime": "skylift.train.runtime",
    "Trainer": "skylift.train.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'skylift' has no attribute {name!r}")

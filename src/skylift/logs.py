"""Logging set-up: rank 0 speaks, other ranks only warn."""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["setup_logging"]


def setup_logging(level: str | None = None) -> None:
    """Rank 0 logs at ``level`` (default: ``SKYLIFT_LOG_LEVEL`` or INFO), other ranks at WARNING."""
    level = level or os.environ.get("SKYLIFT_LOG_LEVEL", "INFO").upper()
    rank = int(os.environ.get("RANK", "0"))
    logger = logging.getLogger("skylift")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    prefix = "skylift" if rank == 0 else f"skylift[rank {rank}]"
    handler.setFormatter(logging.Formatter(f"{prefix}: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else "WARNING")
    logger.propagate = False

"""What an elastic job's agent and its workers tell each other, through this node's
environment and a folder of the agent's (torchrun's workers inherit the agent's
``os.environ``). Imports nothing heavy: the CLI, the agent and the workers all read it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["ELASTIC_DIR_VARIABLE", "EXIT_CODES_FINAL", "KEEP_ALIVE_ATTEMPTS", "NOTICE_MARKER",
           "RESTART_REASON_VARIABLE", "last_step", "write_last_step", "write_notice_marker"]

ELASTIC_DIR_VARIABLE = "SKYLIFT_ELASTIC_DIR"
"""A folder of this node's agent: the workers' notice marker and last finished step."""
RESTART_REASON_VARIABLE = "SKYLIFT_ELASTIC_RESTART"
"""Why the agent restarted the workers: ``notice``, ``node_lost`` or ``node_joined``."""
NOTICE_MARKER = "notice"
"""Written by local rank 0 when this node's own cloud announced its reclaim."""
LAST_STEP_FILE = "last_step.json"
KEEP_ALIVE_ATTEMPTS = 3
"""Missed keep-alives before the rendezvous drops a node (torchrun's default)."""
EXIT_CODES_FINAL = frozenset({2, 3})
"""Worker exits no restart can help: a bad configuration (2), a guard's stop (3)."""


def _folder() -> Path | None:
    folder = os.environ.get(ELASTIC_DIR_VARIABLE)
    return Path(folder) if folder else None


def write_notice_marker() -> None:
    """In a worker: tell this node's agent that the node itself got the reclaim notice."""
    folder = _folder()
    if folder is not None:
        (folder / NOTICE_MARKER).write_text(f"{time.time()}\n")


def write_last_step(step: int) -> None:
    """In local rank 0: the step this node finished last and when (wall clock), which the
    next attempt reads to count the steps and seconds a lost node cost."""
    folder = _folder()
    if folder is None:
        return
    partial = folder / f"{LAST_STEP_FILE}.partial"
    partial.write_text(json.dumps({"step": step, "time": time.time()}))
    partial.replace(folder / LAST_STEP_FILE)  # atomic: a crash mid-write leaves the previous one


def last_step() -> tuple[int, float] | None:
    """(step, wall time) this node's previous attempt finished last, or None."""
    folder = _folder()
    try:
        payload = json.loads((folder / LAST_STEP_FILE).read_text()) if folder is not None else None
    except (OSError, ValueError):
        return None
    return (int(payload["step"]), float(payload["time"])) if payload else None

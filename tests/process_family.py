"""A subprocess and every process it starts, killed together: a test's node or launcher.

torchrun's workers live in sessions of their own and outlive a SIGKILLed agent, so the
descendants are remembered while they run and killed one by one at the end, even orphaned.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import time

import psutil

__all__ = ["ProcessFamily"]


class ProcessFamily:
    """``popen`` (started with ``start_new_session=True``) and its descendants ever seen."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self.popen = popen
        self.family: dict[int, psutil.Process] = {}
        self.family_seen_at = -math.inf

    def remember_family(self, *, every_s: float = 0.0) -> None:
        """Note every descendant, so they can be killed even once orphaned (at most
        once per ``every_s``: walking /proc costs CPU the runs need)."""
        if time.monotonic() - self.family_seen_at < every_s:
            return
        self.family_seen_at = time.monotonic()
        try:
            for child in psutil.Process(self.popen.pid).children(recursive=True):
                self.family.setdefault(child.pid, child)
        except psutil.Error:
            pass

    def kill(self) -> None:
        """SIGKILL the process's session and every descendant ever seen (idempotent)."""
        if self.popen.poll() is None:
            self.remember_family()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        for process in self.family.values():
            with contextlib.suppress(psutil.Error):
                process.kill()  # psutil refuses a pid that now belongs to another process
        self.popen.wait(30)
        psutil.wait_procs(list(self.family.values()), timeout=30)

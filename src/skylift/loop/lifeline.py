"""A worker dies with its launcher.

torchrun starts each worker in a session of its own, so a ``kill -9`` of the launcher's
process group leaves the workers training, unwatched, into the same folders a rerun
then writes too. ``skylift launch`` puts its own process id in
``SKYLIFT_LAUNCHER_PID``; :func:`die_with_launcher`, called first thing in the worker,
asks Linux to SIGKILL the worker when its parent ends (``PR_SET_PDEATHSIG``) and checks
that the parent is still the launcher (it may have died before the request).
SIGKILL, not SIGTERM: a launcher that is gone can no longer collect a clean stop, and a
script that ignores SIGTERM must not train on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Mapping

__all__ = ["LAUNCHER_PID_VARIABLE", "die_with_launcher"]

LAUNCHER_PID_VARIABLE = "SKYLIFT_LAUNCHER_PID"
"""The process id of the ``skylift launch`` process whose workers these are."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Tie this process's life to the launcher's; True when tied (Linux, launcher known).

    Ends this process at once (exit 137, as a SIGKILL would) when the launcher is
    already gone. Elsewhere than Linux it does nothing and returns False.
    """
    environ = os.environ if environ is None else environ
    launcher = environ.get(LAUNCHER_PID_VARIABLE, "").strip()
    if not launcher or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(error)}")
    if os.getppid() != int(launcher):  # the launcher ended before the request was in place
        print(f"skylift: the launcher (pid {launcher}) is gone; this worker stops", file=sys.stderr)
        os._exit(128 + int(signal.SIGKILL))
    return True

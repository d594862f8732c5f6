"""Named fault points for crash tests (torchsnapshot's faulty-storage pattern).

Production code calls ``fault_point("after_payload", step=..., rank=...)`` at the
moments a crash matters. Nothing happens unless ``SKYLIFT_FAULT_INJECTION`` names that
point, for example ``after_payload:step=10:rank=1:action=kill``. Actions: ``kill``
(SIGKILL this process: no cleanup, no flush, like a lost machine), ``raise`` (an
``OSError``), ``enospc`` (``OSError(ENOSPC)``). Several specs separate with commas.
``restart=N`` matches the Nth restart of an elastic agent's workers (0: the first start).
"""

from __future__ import annotations

import errno
import os
import signal

__all__ = ["FAULT_VARIABLE", "fault_point"]

FAULT_VARIABLE = "SKYLIFT_FAULT_INJECTION"


def fault_point(name: str, **context: int) -> None:
    spec = os.environ.get(FAULT_VARIABLE)
    if not spec:
        return
    # A worker restarted by its agent counts from 1: ``restart=0`` fires in the first attempt only.
    context = {"restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), **context}
    for item in spec.split(","):
        point, *conditions = item.strip().split(":")
        if point != name:
            continue
        options = dict(condition.split("=", 1) for condition in conditions)
        action = options.pop("action", "kill")
        if all(str(context.get(key)) == value for key, value in options.items()):
            _trigger(action, name)


def _trigger(action: str, name: str) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {name})")
    raise OSError(errno.EIO, f"injected fault at {name}")

"""The launcher watches the cloud's notices for every script, skylift or not.

A plain torchrun script knows nothing of metadata services; it should handle SIGTERM
(save, exit). :class:`NoticeRelay` polls the detected cloud's metadata service in the
``skylift launch`` process (:class:`skylift.cloud.notice.NoticeWatcher`, the one
``skylift run``'s workers use) and turns a spot or maintenance notice into SIGTERM to
each worker, then SIGKILL to any still alive at the notice's deadline: the grace the
cloud gave, not a fixed one. It also writes the notice where the workers' own signal
handlers read it (:data:`skylift.cloud.notice.RELAYED_NOTICE_VARIABLE`), so a skylift
worker that hears the SIGTERM records the cloud's deadline, not a guessed window.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

__all__ = ["NoticeRelay"]

log = logging.getLogger("skylift")

_MINIMUM_GRACE_S = 1.0
"""A notice read past its deadline still gives the workers this long after SIGTERM."""


class NoticeRelay:
    """Start before the workers, :meth:`stop` after; :attr:`relayed` says whether a notice came.

    ``environment()`` gives the variables the workers need (set them before they start).
    Off any detected cloud (``SKYLIFT_CLOUD`` unset, no cloud's DMI data) nothing is polled.
    """

    def __init__(self, *, cloud: str | None = None, poll_interval_s: float | None = None) -> None:
        from skylift.cloud.notice import detect_cloud

        self.cloud = cloud or detect_cloud()
        self.poll_interval_s = poll_interval_s
        self.relayed: Any = None
        """The notice turned into SIGTERM, once one was."""
        self._folder = Path(tempfile.mkdtemp(prefix="skylift-notice-"))
        self.notice_file = self._folder / "notice.json"
        self._watcher: Any = None
        self._kill_timer: threading.Timer | None = None

    def environment(self) -> dict[str, str]:
        from skylift.cloud.notice import RELAYED_NOTICE_VARIABLE

        return {RELAYED_NOTICE_VARIABLE: str(self.notice_file)}

    def start(self) -> NoticeRelay:
        if self.cloud is None:
            return self
        from skylift.cloud.notice import NoticeWatcher

        self._watcher = NoticeWatcher(self._on_notice, cloud=self.cloud, poll_interval_s=self.poll_interval_s).start()
        print(f"skylift: watching {self.cloud} spot/maintenance notices for the workers "
              "(a notice reaches them as SIGTERM)", file=sys.stderr)
        return self

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self._kill_timer is not None:
            self._kill_timer.cancel()
        self.notice_file.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: another file is not this relay's to delete
            self._folder.rmdir()

    def _on_notice(self, notice: Any) -> None:
        if notice.kind == "rebalance":
            print(f"skylift: {notice.cloud} rebalance recommendation: capacity may be reclaimed soon", file=sys.stderr)
            return
        self.relayed = notice
        grace_s = max(notice.seconds_left() or 0.0, _MINIMUM_GRACE_S)
        record = {"cloud": notice.cloud, "kind": notice.kind, "detail": notice.detail,
                  "received_at_s": notice.received_at_s, "deadline_s": notice.deadline_s}
        partial = self.notice_file.with_suffix(".partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, self.notice_file)  # a worker's handler reads it whole or not at all
        workers = _workers()
        print(f"skylift: {notice.cloud} {notice.kind} notice ({notice.detail}), {grace_s:.0f} s left: SIGTERM to "
              f"{len(workers)} worker(s), SIGKILL to any left at the deadline", file=sys.stderr, flush=True)
        for worker in workers:
            _send(worker, signal.SIGTERM)
        self._kill_timer = threading.Timer(grace_s, self._kill_the_rest)
        self._kill_timer.daemon = True
        self._kill_timer.start()

    def _kill_the_rest(self) -> None:
        left = [worker for worker in _workers() if worker.is_running()]
        if left:
            print(f"skylift: the notice's deadline passed; SIGKILL to {len(left)} worker(s)", file=sys.stderr)
        for worker in left:
            _send(worker, signal.SIGKILL)


def _workers() -> list[Any]:
    """This launcher's child processes: torchrun's workers (each in a session of its own)."""
    import psutil

    return psutil.Process().children(recursive=False)


def _send(process: Any, signal_number: int) -> None:
    import psutil

    with contextlib.suppress(psutil.Error):  # it ended meanwhile
        process.send_signal(signal_number)

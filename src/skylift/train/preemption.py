"""Turn spot notices and signals into an agreed stop (see :mod:`skylift.loop.agreement`).

Local rank 0 of each node polls the cloud's metadata service; every rank handles
SIGTERM/SIGUSR1 (torchrun forwards the signal to all workers). Whoever hears first
records a stop request; all ranks stop together at the next step boundary.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from typing import Any

from skylift.config.schema import PreemptionConfig
from skylift.loop.agreement import StepAgreement, StopReason

__all__ = ["PreemptionWatch"]

log = logging.getLogger("skylift")


class PreemptionWatch:
    """Starts the watchers on :meth:`start`, stops them on :meth:`stop`."""

    def __init__(self, config: PreemptionConfig, agreement: StepAgreement, *, local_rank: int) -> None:
        self.config = config
        self.agreement = agreement
        self.local_rank = local_rank
        self.notice: Any = None
        self._watcher: Any = None
        self._restore_signals: Any = None

    def start(self) -> None:
        if not self.config.enabled:
            return
        from skylift.cloud.notice import NoticeWatcher, detect_cloud, watch_signals

        cloud = None if self.config.cloud in ("auto", "off") else self.config.cloud
        if self.config.cloud == "auto":
            cloud = detect_cloud()
        self._restore_signals = _install_signals(watch_signals, self._on_notice, self.config.grace_s)
        if cloud is not None and self.local_rank == 0:
            self._watcher = NoticeWatcher(self._on_cloud_notice, cloud=cloud,
                                          poll_interval_s=self.config.poll_interval_s)
            self._watcher.start()
            log.info("watching %s spot/preemption notices", cloud)

    def stop(self, *, leaving_until_s: float | None = None) -> None:
        """Stop watching. ``leaving_until_s``: the run stopped for a notice and the process
        is on its way out; a SIGTERM or SIGUSR1 until then is that notice again (the
        launcher relays the cloud's notice to every worker; a rank that polled it itself
        may already be in its exit barrier), so it is ignored instead of killing this rank
        mid-exit, which would fail its peers' barrier. After that time a signal acts as it
        did before skylift watched (the launcher's SIGKILL at the deadline still bounds it)."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._restore_signals is not None:
            self._restore_signals()
            self._restore_signals = None
            if leaving_until_s is not None:
                _ignore_signals_until(leaving_until_s)

    def _on_cloud_notice(self, notice: Any) -> None:
        if notice.kind != "rebalance":
            # In an elastic job this node leaves after the save and the others continue;
            # a SIGTERM needs no marker (it reaches the agent too, which then exits).
            from skylift.train.elastic_environment import write_notice_marker

            write_notice_marker()
        self._on_notice(notice)

    def _on_notice(self, notice: Any) -> None:
        if notice.kind == "rebalance":
            log.warning("%s rebalance recommendation: capacity may be reclaimed soon", notice.cloud)
            self.agreement.request_save()
            return
        self.notice = notice
        self.agreement.request_stop(StopReason.PREEMPTED, notice.deadline_s, notice.received_at_s)


def _install_signals(watch_signals: Any, on_notice: Any, grace_s: float | None) -> Any:
    import threading

    if threading.current_thread() is not threading.main_thread():
        log.warning("not on the main thread: SIGTERM/SIGUSR1 will not trigger a checkpoint")
        return None
    return watch_signals(on_notice, (signal.SIGTERM, signal.SIGUSR1), grace_s=grace_s)


def _ignore_signals_until(until_s: float) -> None:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    if not math.isfinite(until_s):
        from skylift.cloud.notice import DEFAULT_SIGNAL_GRACE_S

        until_s = time.time() + DEFAULT_SIGNAL_GRACE_S
    previous: dict[int, Any] = {int(number): signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1)}
    told = False

    def handle(signal_number: int, frame: Any) -> None:
        nonlocal told
        if time.time() < until_s:
            if not told:
                told = True
                log.info("%s while leaving for the preemption notice: already stopping",
                         signal.Signals(signal_number).name)
            return
        handler = previous[signal_number]
        signal.signal(signal_number, handler)
        if callable(handler):
            handler(signal_number, frame)
        elif handler != signal.SIG_IGN:
            os.kill(os.getpid(), signal_number)  # the default action: end the process

    for number in previous:
        signal.signal(number, handle)

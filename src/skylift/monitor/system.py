"""A background sampler of host (psutil) and GPU (NVML) figures, one per node.

It runs on a daemon thread at ``monitor.system_interval_s`` and hands finished
``system`` records to a sink; it never touches the training thread's tensors, so it
adds no device synchronisation. Without GPUs (or NVML) it records the host and says
so once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from skylift.monitor.nvml import Nvml

__all__ = ["SystemSampler", "host_figures"]

log = logging.getLogger("skylift")

_GIB = 1024**3
_MB = 1e6


class _Rates:
    """Turns cumulative counters (bytes read, sent, ...) into per-second rates."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._last_time = 0.0

    def update(self, counters: dict[str, float], now: float) -> dict[str, float | None]:
        elapsed = now - self._last_time
        rates: dict[str, float | None] = {}
        for name, value in counters.items():
            previous = self._last.get(name)
            rates[name] = None if previous is None or elapsed <= 0 else round((value - previous) / elapsed / _MB, 3)
        self._last, self._last_time = counters, now
        return rates


def host_figures(rates: _Rates | None = None) -> dict[str, Any]:
    """CPU, memory, disk and network of this machine (rates need a previous sample)."""
    import psutil

    memory = psutil.virtual_memory()
    figures: dict[str, Any] = {
        # interval=None: the share since the previous call, so sampling does not block
        "cpu_percent": psutil.cpu_percent(interval=None),
        "memory_used_gib": round((memory.total - memory.available) / _GIB, 3),
        "memory_total_gib": round(memory.total / _GIB, 3),
    }
    counters: dict[str, float] = {}
    disk = psutil.disk_io_counters()
    if disk is not None:
        counters.update(disk_read_mb_s=disk.read_bytes, disk_write_mb_s=disk.write_bytes)
    network = psutil.net_io_counters()
    if network is not None:
        counters.update(net_recv_mb_s=network.bytes_recv, net_sent_mb_s=network.bytes_sent)
    if rates is not None:
        figures.update(rates.update(counters, time.monotonic()))
    return figures


class SystemSampler:
    """Samples every ``interval_s`` on a daemon thread until :meth:`stop`.

    Args:
        interval_s: seconds between samples.
        sink: called with each ``system`` record (from the sampler thread).
        node_rank: written into each record.
        step: returns the optimizer steps completed, to place samples on the step axis.
    """

    def __init__(
        self,
        interval_s: float,
        sink: Callable[[dict[str, Any]], None],
        *,
        node_rank: int = 0,
        step: Callable[[], int] = lambda: 0,
    ) -> None:
        self.interval_s = interval_s
        self._sink = sink
        self._node_rank = node_rank
        self._step = step
        self._rates = _Rates()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nvml: Nvml | None = None

    def start(self) -> None:
        self.nvml = Nvml()
        if not self.nvml.available:
            log.info("system monitor: host figures only (%s)", self.nvml.reason)
        host_figures(self._rates)  # primes the CPU share and the rate counters
        self._thread = threading.Thread(target=self._run, name="skylift-system-sampler", daemon=True)
        self._thread.start()

    def sample(self) -> dict[str, Any]:
        gpus = self.nvml.sample() if self.nvml is not None and self.nvml.available else []
        return {
            "kind": "system",
            "node_rank": self._node_rank,
            "step": self._step(),
            "host": host_figures(self._rates),
            "gpus": gpus,
            "time": time.time(),
        }

    def stop(self) -> None:
        """Stop the thread and take one last sample, so short runs have at least one."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self.interval_s))
        self._thread = None
        self._emit()
        if self.nvml is not None:
            self.nvml.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._emit()

    def _emit(self) -> None:
        try:
            self._sink(self.sample())
        except Exception:  # monitoring must never end a training run
            log.debug("system sample failed", exc_info=True)

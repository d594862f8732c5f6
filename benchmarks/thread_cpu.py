"""CPU seconds per group of this process's threads, sampled from ``/proc/self/task``.

``time.process_time()`` sums every thread; to tell the in-process moto server's share
from the checkpoint writer's and the training's, a daemon thread reads each thread's
``utime + stime`` every ``interval_s`` and maps thread ids to Python thread names.
A thread that ends between two samples loses at most ``interval_s`` of CPU time.
Linux only; elsewhere :meth:`ThreadCpu.by_group_s` is empty.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11's; this stays an annotation

__all__ = ["ThreadCpu", "group_of"]

_TASKS = Path("/proc/self/task")
_SAMPLER_NAME = "bench-thread-cpu"


def group_of(name: str | None) -> str:
    """The group a thread's CPU time is reported under."""
    if name is None:
        return "native (torch/OpenMP, SDK)"
    rules = (
        ("process_request_thread", "moto server"), ("_server_entry", "moto server"),
        ("skylift-checkpoint", "checkpoint writer"), ("skylift-s3-part", "S3 upload parts"),
        ("ThreadPoolExecutor", "boto3 upload"),
        ("MainThread", "main (training, capture)"), ("skylift-notice", "notice watcher"),
        ("fake-metadata", "metadata server"), (_SAMPLER_NAME, "cpu sampler"),
    )  # fmt: skip
    return next((group for needle, group in rules if needle in name), "other python")


def _read_ticks() -> dict[int, int]:
    ticks = {}
    for entry in os.listdir(_TASKS):
        try:
            fields = (_TASKS / entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # the thread ended while listing
            continue
        ticks[int(entry)] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


class ThreadCpu:
    """``with ThreadCpu() as cpu: ...`` then ``cpu.by_group_s()``."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self.available = _TASKS.is_dir()
        self._baseline: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=_SAMPLER_NAME, daemon=True)

    def __enter__(self) -> Self:
        if self.available:
            self._sample()
            self._baseline = dict(self._last)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.available:
            self._stop.set()
            self._thread.join()
            self._sample()

    def by_group_s(self) -> dict[str, float]:
        ticks_per_s = os.sysconf("SC_CLK_TCK")
        groups: dict[str, float] = {}
        for tid, ticks in self._last.items():
            group = group_of(self._names.get(tid))
            groups[group] = groups.get(group, 0.0) + (ticks - self._baseline.get(tid, 0)) / ticks_per_s
        return {group: round(seconds, 3) for group, seconds in sorted(groups.items()) if seconds > 0}

    def _sample(self) -> None:
        self._names.update({t.native_id: t.name for t in threading.enumerate() if t.native_id is not None})
        self._last.update(_read_ticks())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

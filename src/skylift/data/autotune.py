"""``data.num_workers: auto``: a short measured sweep of loader settings at start.

Each candidate worker count gets a fresh loader; after its workers have started and
filled their prefetch queues (not counted: a long run pays that once), batches are
timed for a fixed budget. The fastest setting wins; a setting within
``TIE_SHARE`` of it with fewer workers wins instead, because every worker process
takes CPU, memory and start-up time from the training process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoaderSweep", "default_candidates", "measure_loader", "sweep_num_workers"]

log = logging.getLogger("skylift")

TIE_SHARE = 0.05
"""Settings this close to the fastest count as equally fast."""


@dataclass
class LoaderSweep:
    chosen: int
    results: dict[int, float] = field(default_factory=dict)
    """Measured samples/s per worker count."""
    seconds: float = 0.0
    """Wall time the sweep took."""

    def as_record(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "results": {str(k): round(v, 2) for k, v in self.results.items()},
                "sweep_s": round(self.seconds, 3)}


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_candidates(cpus: int | None = None) -> list[int]:
    """0, 1, 2, 4, ... up to the CPUs this process may use (at most 16)."""
    cpus = available_cpus() if cpus is None else cpus
    ladder = [0, 1, 2, 3, 4, 6, 8, 12, 16]
    return [n for n in ladder if n <= max(min(cpus, 16), 1)]


def measure_loader(batches: Iterable[Any], batch_size: Callable[[Any], int], *, warmup_batches: int,
                   budget_s: float, min_batches: int = 3) -> float:
    """Samples/s of ``batches`` after ``warmup_batches``, timed for about ``budget_s``."""
    started: float | None = None
    samples = timed = 0
    for index, batch in enumerate(batches):
        if index < warmup_batches:
            continue
        if started is None:  # the clock starts once the warm-up batches are out of the way
            started = time.perf_counter()
            continue
        samples += batch_size(batch)
        timed += 1
        if timed >= min_batches and time.perf_counter() - started >= budget_s:
            break
    if started is None or timed == 0:
        return 0.0
    return samples / (time.perf_counter() - started)


def sweep_num_workers(
    make_batches: Callable[[int], Iterable[Any]],
    batch_size: Callable[[Any], int],
    *,
    candidates: list[int] | None = None,
    budget_s: float = 1.0,
    prefetch_factor: int = 2,
) -> LoaderSweep:
    """Measure ``make_batches(num_workers)`` for each candidate and pick the fastest."""
    candidates = candidates or default_candidates()
    started = time.perf_counter()
    results: dict[int, float] = {}
    for workers in candidates:
        results[workers] = measure_loader(
            make_batches(workers), batch_size, warmup_batches=1 + workers * prefetch_factor, budget_s=budget_s
        )
        log.info("data.num_workers=%d: %.1f samples/s", workers, results[workers])
    best = max(results.values())
    chosen = min(n for n, rate in results.items() if rate >= best * (1 - TIE_SHARE))
    return LoaderSweep(chosen=chosen, results=results, seconds=time.perf_counter() - started)

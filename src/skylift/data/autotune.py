"""``data.num_workers: auto``: pick the loader's worker count by measuring training.

A loader timed alone says little about a training run: on a machine with few cores,
workers that decode fast in isolation take the cores the model needs. So
:class:`LoaderTuner` measures the real thing. skylift's sample order does not depend
on the number of workers, so the first steps of the run train with each candidate in
turn (a fresh loader continues at the exact next batch), are timed after each
switch's start-up, and the run goes on with the fastest: the trials cost no extra
work and change no result. A setting within ``TIE_SHARE`` of the fastest with fewer
workers wins instead, because every worker takes CPU, memory and start-up time.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

__all__ = ["LoaderTuner", "available_cpus", "default_candidates"]

log = logging.getLogger("skylift")

TIE_SHARE = 0.05
"""Settings this close to the fastest count as equally fast."""


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


class LoaderTuner:
    """Decides, step by step, which worker count the training loop should use next.

    Args:
        candidates: worker counts to try, in order (the first is what the run starts with).
        budget_s: seconds each candidate is timed for (at least ``min_steps`` steps).
        warmup_steps: steps after each switch that are not timed (workers starting).
        min_steps: timed steps per candidate at least.
    """

    def __init__(self, candidates: list[int], *, budget_s: float, warmup_steps: int = 1, min_steps: int = 3) -> None:
        if not candidates:
            raise ValueError("LoaderTuner needs at least one candidate")
        self.candidates = candidates
        self.budget_s = budget_s
        self.warmup_steps = warmup_steps
        self.min_steps = min_steps
        self.results: dict[int, float] = {}
        self.chosen: int | None = None
        self._index = 0
        self._steps = 0
        self._samples = 0
        self._started_at: float | None = None
        self.steps_seen = 0
        self.decided_at_step: int | None = None
        """Steps (counted from the tuner's first) after which the choice took effect."""

    @property
    def current(self) -> int:
        return self.chosen if self.chosen is not None else self.candidates[self._index]

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def restart_timing(self) -> None:
        """A new loader iterator started (a new epoch): its start-up is not timed either."""
        self._steps, self._samples, self._started_at = 0, 0, None

    def after_step(self, samples: int) -> int | None:
        """Record a finished step of ``samples``; return a worker count to switch to, or None."""
        if self.done:
            return None
        self.steps_seen += 1
        self._steps += 1
        if self._steps <= self.warmup_steps:
            self._started_at = time.perf_counter()
            return None
        self._samples += samples
        elapsed = time.perf_counter() - (self._started_at or time.perf_counter())
        if self._steps - self.warmup_steps < self.min_steps or elapsed < self.budget_s:
            return None
        self.results[self.current] = self._samples / elapsed if elapsed > 0 else 0.0
        log.info("data.num_workers=%d: %.1f samples/s while training", self.current, self.results[self.current])
        self.restart_timing()
        if self._index + 1 < len(self.candidates):
            self._index += 1
            return self.candidates[self._index]
        best = max(self.results.values())
        self.chosen = min(n for n, rate in self.results.items() if rate >= best * (1 - TIE_SHARE))
        self.decided_at_step = self.steps_seen
        return self.chosen if self.chosen != self.candidates[-1] else None

    def as_record(self, step: int) -> dict[str, Any]:
        return {"kind": "autotune", "step": step, "setting": "data.num_workers", "chosen": self.chosen,
                "results": {str(n): round(rate, 2) for n, rate in self.results.items()},
                "budget_s": self.budget_s, "time": time.time()}

"""One retry policy for all object-store I/O: capped exponential backoff, full jitter,
a total deadline, and an explicit split between transient and permanent errors.

Full jitter (sleep uniformly in [0, min(cap, base * 2**attempt)]) spreads the retries of
many workers hitting the same throttled prefix; see the AWS Architecture Blog,
"Exponential Backoff And Jitter".
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from skylift.storage.errors import StorageTransientError

__all__ = ["RetryPolicy"]

log = logging.getLogger("skylift")
T = TypeVar("T")


@dataclass
class RetryPolicy:
    """Retries ``StorageTransientError``; everything else propagates at once.

    Args:
        max_attempts: attempts in all, the first included.
        base_delay_s: the backoff cap of the first retry.
        max_delay_s: the largest backoff cap.
        deadline_s: no retry starts after this many seconds from the first attempt.
        sleep, clock, uniform: injectable for tests (a fake clock).
    """

    max_attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0
    deadline_s: float = 120.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    uniform: Callable[[float, float], float] = random.uniform
    attempts_log: list[float] = field(default_factory=list, repr=False)
    """Backoff delays slept, most recent last (for tests and diagnostics)."""

    def run(self, operation: Callable[[], T], *, what: str) -> T:
        started = self.clock()
        for attempt in range(1, self.max_attempts + 1):
            try:
                return operation()
            except StorageTransientError as error:
                delay = self.uniform(0.0, min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)))
                out_of_time = self.clock() - started + delay > self.deadline_s
                if attempt == self.max_attempts or out_of_time:
                    raise StorageTransientError(
                        f"{what} failed after {attempt} attempts over {self.clock() - started:.1f} s: {error}"
                    ) from error
                log.warning("%s: %s; retry %d in %.2f s", what, error, attempt, delay)
                self.attempts_log.append(delay)
                self.sleep(delay)
        raise AssertionError("unreachable")

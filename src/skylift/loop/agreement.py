"""Decisions every rank must take at the same step: stop, and checkpoint now.

A rank that learns something (a spot notice on node 0, SIGTERM on one worker, a
failed background save, the checkpoint clock on rank 0) records a request here. At
each step boundary the requests are combined across ranks with one all-reduce (MAX)
on a dedicated gloo group, so all ranks act on the same step and none is left alone
in a collective (the hang of NeMo Automodel #3254).

The all-reduce is started at step ``s`` and read at step ``s + 1``: it overlaps a
whole training step, so the agreement costs no stall, and every rank still reads the
same result at the same step.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from skylift.loop.collectives import collective

__all__ = ["Decision", "StepAgreement", "StopReason"]


class StopReason:
    """Stop codes; a higher code wins when several are requested at once."""

    NONE = 0
    SAVE_FAILED = 1
    GUARD = 2
    """A guard (budget, idle GPU): save without a notice window, then exit 3."""
    PREEMPTED = 3
    """Wins over a guard: its save must fit the notice window."""
    ROOT_LOST = 4
    """The checkpoint root can no longer be written (another job took the lease, or the
    store stayed unreachable past ``checkpoint.unreachable_limit_s``): stop without saving.
    Wins over everything: no save is possible."""

    NAMES = {SAVE_FAILED: "checkpoint save failed", GUARD: "guard", PREEMPTED: "preemption notice",
             ROOT_LOST: "checkpoint root lost"}


@dataclass(frozen=True)
class Decision:
    stop_code: int = StopReason.NONE
    deadline_s: float = math.inf
    """Earliest known time.time() at which the machines go away (inf when unknown)."""
    save: bool = False
    noticed_at_s: float = math.inf
    """Earliest time.time() at which any rank learned of the stop (inf when none)."""

    @property
    def stop_reason(self) -> str | None:
        return StopReason.NAMES.get(self.stop_code)


class StepAgreement:
    """Collects local requests (thread-safe) and exchanges them at step boundaries."""

    def __init__(self, group: Any = None, distributed: bool = False) -> None:
        self._group = group
        self._distributed = distributed
        # Reentrant: a signal handler may request a stop while the main thread holds it.
        self._lock = threading.RLock()
        self._stop_code = StopReason.NONE
        self._deadline_s = math.inf
        self._noticed_at_s = math.inf
        self._save = False
        self._pending: tuple[Any, torch.Tensor] | None = None

    def request_stop(self, code: int, deadline_s: float | None = None, noticed_at_s: float | None = None) -> None:
        with self._lock:
            self._stop_code = max(self._stop_code, code)
            if deadline_s is not None:
                self._deadline_s = min(self._deadline_s, deadline_s)
            self._noticed_at_s = min(self._noticed_at_s, noticed_at_s if noticed_at_s is not None else time.time())

    def request_save(self) -> None:
        with self._lock:
            self._save = True

    def exchange(self) -> Decision:
        """Call on every rank at every step boundary; returns the agreed decision."""
        if not self._distributed:
            return self._local_decision()
        local = self._take_local()
        agreed = Decision()
        if self._pending is not None:
            work, values = self._pending
            with collective("the step agreement (all_reduce of stop and save requests)"):
                work.wait()
            agreed = _decode(values)
        values = local.clone()
        self._pending = (dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self._group, async_op=True), values)
        return agreed

    def flush(self) -> Decision:
        """Finish the exchange in flight (call on every rank before leaving the loop)."""
        if self._pending is None:
            return Decision()
        work, values = self._pending
        self._pending = None
        with collective("the step agreement (all_reduce of stop and save requests)"):
            work.wait()
        return _decode(values)

    def _local_decision(self) -> Decision:
        # One process: no tensor, no collective, just the requests (the common fast path).
        with self._lock:
            decision = Decision(self._stop_code, self._deadline_s, self._save, self._noticed_at_s)
            self._save = False
        return decision

    def _take_local(self) -> torch.Tensor:
        with self._lock:
            # Stop requests persist (a notice stays true); save requests are consumed.
            values = torch.tensor(
                [float(self._stop_code), -self._deadline_s, float(self._save), -self._noticed_at_s], dtype=torch.float64
            )
            self._save = False
        return values


def _decode(values: torch.Tensor) -> Decision:
    stop_code, negative_deadline, save, negative_noticed_at = values.tolist()
    return Decision(int(stop_code), -negative_deadline, bool(save), -negative_noticed_at)

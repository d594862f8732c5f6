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

import enum
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from skylift.errors import EXIT_FAILURE, EXIT_GUARD, EXIT_OK, EXIT_REQUEUE
from skylift.loop.collectives import collective

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11's; this stays an annotation

__all__ = ["Decision", "StepAgreement", "StopReason"]


class StopReason(enum.IntEnum):
    """Why every rank stops early: the code the ranks exchange (a higher code wins when
    several are requested at once), the ``label`` a run records (``stopped_early``, the
    ``reason`` of ``preemption`` and ``run_end`` records), and the process's ``exit_code``.

    The one mapping from a stop to an exit code: the Trainer (``Runtime.close``,
    ``skylift run``) and the framework integrations all read ``exit_code`` here.
    """

    label: str | None
    exit_code: int

    def __new__(cls, code: int, label: str | None, exit_code: int) -> Self:
        member = int.__new__(cls, code)
        member._value_ = code
        member.label = label
        member.exit_code = exit_code
        return member

    NONE = 0, None, EXIT_OK
    SAVE_FAILED = 1, "checkpoint save failed", EXIT_FAILURE
    GUARD = 2, "guard", EXIT_GUARD
    """A guard (budget, idle GPU): save without a notice window, then exit 3."""
    PREEMPTED = 3, "preemption notice", EXIT_REQUEUE
    """Wins over a guard: its save must fit the notice window; exit 143 to be requeued."""
    ROOT_LOST = 4, "checkpoint root lost", EXIT_FAILURE
    """The checkpoint root can no longer be written (another job took the lease, or the
    store stayed unreachable past ``checkpoint.unreachable_limit_s``): stop without saving.
    Wins over everything: no save is possible."""

    @classmethod
    def of_label(cls, label: str | None) -> StopReason:
        """The stop a recorded label names (``None``: no stop).

        Raises:
            ValueError: no stop has that label.
        """
        for reason in cls:
            if reason.label == label:
                return reason
        raise ValueError(f"{label!r} is not a stop reason's label ({', '.join(repr(r.label) for r in cls)})")

    @classmethod
    def of_code(cls, code: int) -> StopReason:
        """The stop the ranks exchanged as ``code`` (what ``StopReason(code)`` does; spelled out
        because the members' three-part values give ``__new__`` three parameters).

        Raises:
            ValueError: no stop has that code.
        """
        for reason in cls:
            if reason == code:
                return reason
        raise ValueError(f"{code!r} is not a valid StopReason")


@dataclass(frozen=True)
class Decision:
    stop_code: StopReason = StopReason.NONE
    deadline_s: float = math.inf
    """Earliest known time.time() at which the machines go away (inf when unknown)."""
    save: bool = False
    noticed_at_s: float = math.inf
    """Earliest time.time() at which any rank learned of the stop (inf when none)."""

    @property
    def stop_reason(self) -> str | None:
        """The label of the agreed stop (None: no stop)."""
        return StopReason.of_code(self.stop_code).label


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

    def request_stop(self, code: StopReason, deadline_s: float | None = None,
                     noticed_at_s: float | None = None) -> None:
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
    return Decision(StopReason.of_code(int(stop_code)), -negative_deadline, bool(save), -negative_noticed_at)

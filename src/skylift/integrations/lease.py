"""The run lease of a framework job: taken at the start, watched at every step boundary.

A Hugging Face or Lightning Trainer writes its own checkpoints, so nothing of skylift's
fences its writes as :class:`~skylift.checkpoint.lease.FencedStore` fences a Runtime's.
Instead rank 0 looks at the lease at every optimizer step (:meth:`RunLease.check`: a
flag read while the heartbeat keeps the lease confirmed; a listing of the lease folder
only when the last confirmation is older than half ``checkpoint.lease_ttl_s``). A lease
another job took over (this job was paused past the lease's life, say) is a
``ROOT_LOST`` stop request that every rank acts on at the same step boundary: no rank
writes a checkpoint after it, and the job ends with one line and exit 1.

The ranks' agreement is exchanged one step late (it overlaps the next step's work), so
at a step where the framework is about to write a checkpoint the ranks first finish the
exchange in flight (:meth:`FrameworkLease.confirm_before_save`): a lease lost at that
step stops the job before the write, not after it.
"""

from __future__ import annotations

import logging
import sys
import uuid
from typing import TYPE_CHECKING

import torch.distributed as dist

from skylift.checkpoint.lease import LeaseHeldError, LeaseLostError, RunLease
from skylift.loop.agreement import StopReason
from skylift.loop.collectives import collective
from skylift.loop.distributed import DistributedContext, exit_cleanly
from skylift.loop.events import TrainState
from skylift.storage import Store
from skylift.train.services import RunServices

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = ["FrameworkLease", "FrameworkServices"]

log = logging.getLogger("skylift")


class FrameworkServices(RunServices):
    """:class:`RunServices` for a loop a framework owns: skylift writes no checkpoint of its
    own here, so a lost root is a lost lease, and the stop names no skylift checkpoint."""

    lease: RunLease | None = None
    """Rank 0's lease (None on the other ranks and before it is taken)."""

    def _stop_for_lost_root(self, state: TrainState) -> None:  # the step_end of RunServices calls it
        self.stop_for_lost_lease(state)

    def stop_for_lost_lease(self, state: TrainState) -> None:
        """Every rank, at the same step boundary: stop without another checkpoint, say why.

        Raises:
            LeaseLostError: always (on every rank).
        """
        if self.context.is_distributed:
            self.agreement.flush()  # no rank is left in the exchange in flight
        state.stop_requested = self.stopped = StopReason.ROOT_LOST.label
        if self.lease is not None:
            self.lease.abandon()  # the root is the other job's now: release writes nothing to it
        problem = self.root_problem or "rank 0 found the run lease taken over by another job (rank 0's line says why)"
        raise LeaseLostError(f"stopped at step {state.step}: {problem}")


class FrameworkLease:
    """Rank 0 holds the lease of the framework's checkpoint root; every rank acts on its loss.

    Args:
        config: the run configuration (``checkpoint.lease_ttl_s``).
        context: where this process sits in the job.
        services: the run's services (their agreement carries the stop to every rank).
        group: a gloo group of every rank (None in a one-process job).
    """

    def __init__(self, config: RunConfig, context: DistributedContext, services: FrameworkServices,
                 group: dist.ProcessGroup | None) -> None:
        self.config = config
        self.context = context
        self.services = services
        self.group = group
        self.lease: RunLease | None = None

    def take(self, root: Store, *, job_name: str) -> None:
        """Hold the run lease of ``root`` (where the framework's checkpoints go).

        Rank 0 takes it (or joins the one ``skylift launch --checkpoint-root`` holds for its
        workers) and heartbeats it until :meth:`release`; every rank learns the outcome.

        Raises:
            LeaseHeldError: another live job holds it (every rank; the shim prints rank 0's one line).
        """
        refusal = None
        if self.context.is_main:
            job_id = f"{job_name}-{uuid.uuid4().hex[:8]}"
            lease = RunLease(root, ttl_s=self.config.checkpoint.lease_ttl_s, job_id=job_id)
            try:
                lease.acquire()
                self.lease = self.services.lease = lease
            except LeaseHeldError as held:
                refusal = f"{held} (another job is writing these checkpoints)"
        if self.group is not None:
            holder = [refusal]
            dist.broadcast_object_list(holder, src=0, group=self.group)
            refusal = holder[0]
        if refusal:
            raise LeaseHeldError(refusal)

    def watch(self) -> None:
        """Rank 0, at every step boundary before the ranks' exchange: a lease another job took
        over asks every rank to stop (``ROOT_LOST``)."""
        if self.lease is None or self.services.root_problem is not None:
            return
        try:
            self.lease.check()
        except LeaseLostError as lost:
            self.services.root_problem = str(lost)
            self.services.agreement.request_stop(StopReason.ROOT_LOST)

    def confirm_before_save(self, state: TrainState) -> None:
        """Every rank, at a step whose checkpoint the framework is about to write: finish the
        exchange in flight, so a lease lost at this step stops the job before the write.

        Other stop requests in that exchange stay requested (they persist) and stop the job
        at the next boundary as they would have.

        Raises:
            LeaseLostError: another job took the lease over (every rank).
        """
        if not self.context.is_distributed:
            return  # one process: the exchange at this boundary was already immediate
        decision = self.services.agreement.flush()
        if decision.stop_code == StopReason.ROOT_LOST:
            self.services.stop_for_lost_lease(state)

    def end(self, lost: LeaseLostError, *, exit_process: bool) -> None:
        """After every rank stopped for a lost lease: rank 0 says why in one line, then every
        process ends with exit 1 (``exit_process``); else the error goes on to the caller.

        Raises:
            LeaseLostError: ``lost``, when ``exit_process`` is False.
        """
        if not exit_process:
            raise lost
        if self.context.is_main:
            print(f"skylift: error: {lost}", file=sys.stderr, flush=True)
        if self.group is not None:
            # Every rank is here (the stop was agreed): no rank's exit makes the launcher
            # stop rank 0 before its line is out.
            with collective("the lost lease's exit barrier"):
                dist.barrier(group=self.group)
        exit_cleanly(StopReason.ROOT_LOST.exit_code)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = self.services.lease = None

"""``skylift launch`` holds the run lease for whatever program it starts.

A plain script given ``SKYLIFT_CHECKPOINT_ROOT`` (``--checkpoint-root``) writes there
without knowing of leases; an unchanged Trainer or Lightning script neither. So the
launcher takes the root's lease (:class:`skylift.checkpoint.lease.RunLease`) before any
worker starts, heartbeats it and releases it at the end: a second job on the same
root is refused in one line, before a worker starts. The workers learn the lease's
owner (:data:`~skylift.checkpoint.lease.LAUNCH_LEASE_VARIABLE`), so a skylift Runtime
inside them joins it instead of refusing its own job.
"""

from __future__ import annotations

import uuid

from skylift.checkpoint.lease import LAUNCH_LEASE_VARIABLE, LeaseHeldError, RunLease
from skylift.errors import SkyliftConfigError

__all__ = ["take_launch_lease"]


def take_launch_lease(checkpoint_root: str) -> tuple[RunLease, dict[str, str]]:
    """The lease on ``checkpoint_root``, held, and the variables its workers need.

    Raises:
        SkyliftConfigError: another live job holds the lease (one line: who, and what to do).
    """
    from skylift.storage import open_store

    lease = RunLease(open_store(checkpoint_root), job_id=f"skylift-launch-{uuid.uuid4().hex[:8]}")
    try:
        lease.acquire()
    except LeaseHeldError as error:
        raise SkyliftConfigError(f"checkpoint root {checkpoint_root} is in use: {error}",
                                 hint="Two jobs writing one checkpoint root would overwrite each other's "
                                 "checkpoints; give this job its own --checkpoint-root.") from None
    return lease, {LAUNCH_LEASE_VARIABLE: lease.owner}

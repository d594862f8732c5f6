"""A run lease: one job at a time writes a checkpoint root.

The lease is ``LEASE.json`` created with an exclusive write (S3 ``If-None-Match: *``,
a hard link locally), so of two jobs started on the same root exactly one wins. The
holder refreshes a heartbeat; a lease whose heartbeat is older than its TTL, or whose
holder is a dead process on this same host, is stale and may be taken over.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from skylift.errors import SkyliftError
from skylift.storage import StorageNotFoundError, StoragePreconditionFailed, Store

__all__ = ["LEASE", "LeaseHeldError", "RunLease"]

log = logging.getLogger("skylift")
LEASE = "LEASE.json"
ELASTIC_JOB_PREFIX = "skylift-"
"""The rendezvous ids of skylift's elastic jobs (``skylift.train.elastic.rendezvous_id``)."""


class LeaseHeldError(SkyliftError):
    """Another live job holds the run's lease."""


class RunLease:
    """Acquire on start, heartbeat in the background, release on exit.

    Args:
        store: the checkpoint root.
        ttl_s: a heartbeat older than this marks the holder dead.
        job_id: shown to a second writer; defaults to torchrun's run id or a UUID.
    """

    def __init__(self, store: Store, *, ttl_s: float = 60.0, job_id: str | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.owner = uuid.uuid4().hex
        self.job_id = job_id or os.environ.get("TORCHELASTIC_RUN_ID") or self.owner[:12]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lease or raise :class:`LeaseHeldError` at once."""
        # Read first, then create exclusively: some S3-compatible servers ignore
        # If-None-Match, and the create alone would let a second job overwrite a live lease.
        holder = self._read_holder()
        if holder is not None:
            self._refuse_if_live(holder)
            log.warning("taking over a stale lease of job %s", holder.get("job_id") or "?")
            self.store.delete([LEASE])
        try:
            self.store.write_bytes(LEASE, self._record(), if_absent=True)
        except StoragePreconditionFailed:
            self._refuse_if_live(self._read_holder() or {})
            raise LeaseHeldError(
                f"{self.store.describe(LEASE)}: another job took the lease while this one started; "
                "run again once it has stopped"
            ) from None
        self._thread = threading.Thread(target=self._heartbeat, name="skylift-lease", daemon=True)
        self._thread.start()

    def _refuse_if_live(self, holder: dict[str, Any]) -> None:
        if self._is_stale(holder):
            return
        age_s = time.time() - float(holder.get("heartbeat_time", 0))
        raise LeaseHeldError(
            f"{self.store.describe(LEASE)}: run owned by job {holder.get('job_id')} on "
            f"{holder.get('host')} (pid {holder.get('pid')}), heartbeat {age_s:.0f} s ago. Stop that job, "
            f"wait {self.ttl_s:.0f} s after it died, or use another checkpoint.root"
        )

    def release(self) -> None:
        """Stop the heartbeat and delete the lease if it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        holder = self._read_holder()
        if holder is not None and holder.get("owner") == self.owner:
            self.store.delete([LEASE])

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                holder = self._read_holder()
                if holder is None or holder.get("owner") != self.owner:
                    log.error("the run lease %s was taken by another job", self.store.describe(LEASE))
                    return
                self.store.write_bytes(LEASE, self._record())
            except Exception as error:  # a missed heartbeat is retried at the next beat
                log.warning("lease heartbeat failed: %s", error)

    def _record(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "job_id": self.job_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "heartbeat_time": time.time(),
                "ttl_s": self.ttl_s,
            }
        ).encode()

    def _read_holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.store.read_bytes(LEASE))
        except StorageNotFoundError:
            return None
        except ValueError:
            return {}

    def _is_stale(self, holder: dict[str, Any]) -> bool:
        if not holder:
            return True
        if holder.get("job_id") == self.job_id and self.job_id.startswith(ELASTIC_JOB_PREFIX):
            return True  # an earlier attempt of this elastic job: its rendezvous runs one group at a time
        if time.time() - float(holder.get("heartbeat_time", 0)) > float(holder.get("ttl_s", self.ttl_s)):
            return True
        if holder.get("host") == socket.gethostname():
            return not _process_alive(int(holder.get("pid", -1)))
        return False


def _process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by its parent) is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True

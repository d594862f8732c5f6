"""A run lease: one job at a time writes a checkpoint root.

The lease is a series of generations, ``lease/<generation>.json`` under the root. A job
takes the lease by creating the next generation with an exclusive write (S3
``If-None-Match: *``, a hard link locally): of any number of jobs that try the same
generation, exactly one wins, whether the lease was free or its holder's heartbeat had
expired. A takeover never deletes or overwrites another job's generation, so the holder
learns that it lost the lease by seeing a higher one: its heartbeat looks every
``ttl_s / 3``, and :meth:`RunLease.check` (called at every step boundary and before every
checkpoint write) looks again whenever the last confirmation is older than ``ttl_s / 2``
(a process that was paused, say). Generations only grow: a release marks its generation
released instead of deleting it, and a winner deletes only generations below its own.
"""

from __future__ import annotations

import builtins
import json
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

from skylift.errors import SkyliftError
from skylift.storage import StorageError, StorageNotFoundError, StoragePreconditionFailed, Store
from skylift.storage.base import Chunks

__all__ = [
    "LAUNCH_LEASE_VARIABLE",
    "LEASE_FOLDER",
    "FencedStore",
    "LeaseHeldError",
    "LeaseLostError",
    "RunLease",
    "current_holder",
    "lease_generations",
    "lease_key",
]

log = logging.getLogger("skylift")
LEASE_FOLDER = "lease"
ELASTIC_JOB_PREFIX = "skylift-"
"""The rendezvous ids of skylift's elastic jobs (``skylift.launch.elastic.rendezvous_id``)."""
LAUNCH_LEASE_VARIABLE = "SKYLIFT_LAUNCH_LEASE"
"""The owner id of the lease ``skylift launch`` holds for its workers: a worker's lease
finding that owner live joins it (reads, never writes) instead of refusing its own job."""
_GENERATION_NAME = re.compile(r"^(\d+)\.json$")


class LeaseHeldError(SkyliftError):
    """Another live job holds the run's lease."""


class LeaseLostError(SkyliftError):
    """Another job took over this run's lease: this job must stop writing the root."""


def lease_key(generation: int) -> str:
    """The key of one generation of the lease (zero-padded: listings sort by generation)."""
    return f"{LEASE_FOLDER}/{generation:012d}.json"


def lease_generations(store: Store) -> list[int]:
    """The generations of the lease present in ``store``, lowest first."""
    generations = []
    for key in store.list(LEASE_FOLDER):
        match = _GENERATION_NAME.match(key.rpartition("/")[2])
        if match:
            generations.append(int(match.group(1)))
    return sorted(generations)


def current_holder(store: Store) -> dict[str, Any] | None:
    """The record of the lease's highest generation (``released`` once its job ended), or None."""
    generations = lease_generations(store)
    return _read(store, generations[-1]) if generations else None


def _read(store: Store, generation: int) -> dict[str, Any] | None:
    try:
        record = json.loads(store.read_bytes(lease_key(generation)))
    except StorageNotFoundError:
        return None
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


class RunLease:
    """Acquire on start, heartbeat in the background, check at step boundaries, release on exit.

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
        self.generation: int | None = None
        """The generation this job holds (None before :meth:`acquire`)."""
        self._lost: str | None = None
        self._confirmed_at = -math.inf  # time.monotonic() of the last check that found no newer generation
        self._last_renewal_failed = False
        self._lock = threading.Lock()  # one renewal at a time: the heartbeat's or a step boundary's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._joined = False  # the launcher's lease: checked, never written

    def _launcher_holds(self, holder: dict[str, Any]) -> bool:
        launcher = os.environ.get(LAUNCH_LEASE_VARIABLE)
        return bool(launcher) and holder.get("owner") == launcher and not holder.get("released")

    @property
    def lost(self) -> str | None:
        """Why this job no longer holds the lease, once it learned so."""
        return self._lost

    def acquire(self) -> None:
        """Take the lease or raise :class:`LeaseHeldError` at once."""
        generations = lease_generations(self.store)
        current = generations[-1] if generations else 0
        # Read first, then create exclusively: some S3-compatible servers ignore
        # If-None-Match, and the create alone would let a second job take a live lease.
        holder = _read(self.store, current) if current else None
        if holder is not None and self._launcher_holds(holder):
            self.generation, self._joined = current, True
            self._confirmed_at = time.monotonic()
            return
        if holder is not None:
            self._refuse_if_live(holder, current)
            if not holder.get("released"):
                log.warning("taking over a stale lease of job %s", holder.get("job_id") or "?")
        mine = current + 1
        try:
            self.store.write_bytes(lease_key(mine), self._record(), if_absent=True)
        except StoragePreconditionFailed:
            winner = _read(self.store, mine) or {}
            if winner and not self._is_stale(winner):
                self._refuse_if_live(winner, mine)
            raise LeaseHeldError(
                f"{self.store.describe(lease_key(mine))}: another job took the lease while this one started; "
                "run again once it has stopped"
            ) from None
        self.generation = mine
        self._confirmed_at = time.monotonic()
        self._delete_generations_below(mine, generations)
        self._thread = threading.Thread(target=self._heartbeat, name="skylift-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if another job took the lease over.

        Cheap while the heartbeat keeps the lease confirmed; when the last confirmation is
        older than ``ttl_s / 2`` (this process was paused, or the heartbeat is late) it
        looks at the store first, so a job that lost the lease writes nothing more. While
        the store fails the heartbeat, it does not look again: every write fails then too.
        """
        if (self._lost is None and self.generation is not None and not self._last_renewal_failed
                and time.monotonic() - self._confirmed_at > self.ttl_s / 2):
            self._renew(only_if_late=True)
        if self._lost is not None:
            raise LeaseLostError(self._lost)

    def abandon(self) -> None:
        """Stop the heartbeat and let :meth:`release` leave the store alone (it is
        unreachable, or the lease was lost): the lease then expires after ``ttl_s``."""
        self._stop.set()
        self.generation = None

    def release(self) -> None:
        """Stop the heartbeat and mark this job's generation released if it is still the newest."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.generation is None or self._lost is not None or self._joined:
            self.generation = None
            return
        with self._lock:
            try:
                if lease_generations(self.store)[-1:] == [self.generation]:
                    # Marked, not deleted: generations only grow (a job paused past its lease
                    # must find a higher generation, never its own number again).
                    self.store.write_bytes(lease_key(self.generation), self._record(released=True))
            except StorageError as error:
                log.warning("could not release the run lease %s: %s", self.store.describe(LEASE_FOLDER), error)
        self.generation = None

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._renew(only_if_late=False)
            if self._lost is not None:
                log.error("%s", self._lost)
                return

    def _renew(self, *, only_if_late: bool) -> None:
        """Look for a newer generation; if there is none, refresh this job's heartbeat."""
        with self._lock:
            late = time.monotonic() - self._confirmed_at > self.ttl_s / 2
            if self._lost is not None or self.generation is None or (only_if_late and not late):
                return
            try:
                generations = lease_generations(self.store)
                newer = [generation for generation in generations if generation > self.generation]
                if newer or self.generation not in generations:
                    self._lost = self._lost_message(newer)
                    return
                if not self._joined:  # the launcher renews its own lease
                    self.store.write_bytes(lease_key(self.generation), self._record())
            except Exception as error:  # noqa: BLE001 - a missed heartbeat is retried at the next beat
                self._last_renewal_failed = True
                log.warning("lease heartbeat failed: %s", error)
                return
            self._last_renewal_failed = False
            self._confirmed_at = time.monotonic()

    def _lost_message(self, newer: list[int]) -> str:
        holder = (_read(self.store, newer[-1]) or {}) if newer else {}
        who = (f"job {holder.get('job_id')} on {holder.get('host')} (pid {holder.get('pid')})" if holder
               else "another job (this job's lease was removed)")
        return (
            f"{self.store.describe(LEASE_FOLDER)}: the run lease was taken over by {who} after this job's "
            f"heartbeat went unrenewed for more than checkpoint.lease_ttl_s ({self.ttl_s:g} s; was the process "
            "paused?); this job stops without writing the checkpoint root again"
        )

    def _delete_generations_below(self, generation: int, known: Iterable[int]) -> None:
        older = [lease_key(number) for number in known if number < generation]
        if not older:
            return
        try:
            self.store.delete(older)
        except StorageError as error:  # leftovers only cost a listing entry
            log.warning("could not delete old lease generations: %s", error)

    def _refuse_if_live(self, holder: dict[str, Any], generation: int) -> None:
        if self._is_stale(holder):
            return
        age_s = time.time() - float(holder.get("heartbeat_time", 0))
        raise LeaseHeldError(
            f"{self.store.describe(lease_key(generation))}: run owned by job {holder.get('job_id')} on "
            f"{holder.get('host')} (pid {holder.get('pid')}), heartbeat {age_s:.0f} s ago. Stop that job, "
            f"wait {self.ttl_s:.0f} s after it died, or use another checkpoint.root"
        )

    def _record(self, *, released: bool = False) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "job_id": self.job_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "heartbeat_time": time.time(),
                "ttl_s": self.ttl_s,
                "released": released,
            }
        ).encode()

    def _is_stale(self, holder: dict[str, Any]) -> bool:
        if not holder or holder.get("released"):
            return True
        if holder.get("job_id") == self.job_id and self.job_id.startswith(ELASTIC_JOB_PREFIX):
            return True  # an earlier attempt of this elastic job: its rendezvous runs one group at a time
        if time.time() - float(holder.get("heartbeat_time", 0)) > float(holder.get("ttl_s", self.ttl_s)):
            return True
        if holder.get("host") == socket.gethostname():
            return not _process_alive(int(holder.get("pid", -1)))
        return False


class FencedStore(Store):
    """The checkpoint root as its lease holder writes it: every write and delete first
    checks the lease (:meth:`RunLease.check`), so a job that lost the lease (a paused
    process that woke up, say) raises :class:`LeaseLostError` instead of writing over the
    new holder's checkpoints, even from a save already in flight. Reads pass through."""

    def __init__(self, store: Store, lease: RunLease | None) -> None:
        self.inner = store
        self.lease = lease
        self.url = store.url

    def _check(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._check()
        self.inner.write_bytes(key, data, if_absent=if_absent)

    def write_chunks(self, key: str, make_chunks: Chunks) -> None:
        self._check()
        self.inner.write_chunks(key, make_chunks)

    def delete(self, keys: Iterable[str]) -> None:
        self._check()
        self.inner.delete(keys)

    def delete_prefix(self, prefix: str) -> None:
        self._check()
        self.inner.delete_prefix(prefix)

    def read_bytes(self, key: str) -> bytes:
        return self.inner.read_bytes(key)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.read_range(key, start, end)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def temporary_keys(self, prefix: str = "") -> builtins.list[str]:  # builtins: `list` is the method above
        return self.inner.temporary_keys(prefix)

    def describe(self, key: str = "") -> str:
        return self.inner.describe(key)

    def __getattr__(self, name: str) -> Any:
        # Backend specifics (a LocalStore's path(), an S3Store's endpoint_url) pass through.
        return getattr(self.inner, name)


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

"""A contender for the run lease, in a process of its own: ``python -m tests.checkpoint.lease_contender NAME``.

Reads lines ``ROOT_URL START_AT`` on stdin; for each, spins until ``time.time() >= START_AT``
(so that two contenders try within microseconds of each other), tries to take the lease of
ROOT_URL, and answers ``won`` or ``lost``. The winner's heartbeat is stopped, not released:
the test reads who holds the lease afterwards. The S3 endpoint comes from
``SKYLIFT_S3_ENDPOINT_URL``.
"""

from __future__ import annotations

import sys
import time

from skylift.checkpoint.lease import LeaseHeldError, RunLease
from skylift.storage import open_store


def main(name: str) -> None:
    for line in sys.stdin:
        url, start_at = line.split()
        store = open_store(url)
        lease = RunLease(store, ttl_s=60.0, job_id=name)
        while time.time() < float(start_at):
            pass
        try:
            lease.acquire()
        except LeaseHeldError:
            print("lost", flush=True)
            continue
        lease._stop.set()  # a winner that keeps the lease, without a heartbeat thread per trial
        print("won", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

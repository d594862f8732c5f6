"""The run lease on local and S3 roots: one writer at a time, stale leases taken over."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from skylift.checkpoint.lease import LEASE, LeaseHeldError, RunLease


def _write_lease(store, **fields):
    record = {"owner": "someone", "job_id": "job-7", "host": "other-host", "pid": 4242,
              "heartbeat_time": time.time(), "ttl_s": 60.0, **fields}
    store.write_bytes(LEASE, json.dumps(record).encode())


def test_second_writer_is_refused_while_the_first_lives(store):
    first = RunLease(store, job_id="first-job")
    first.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(LeaseHeldError, match=r"run owned by job first-job on .* \(pid \d+\)"):
            RunLease(store, job_id="second-job").acquire()
        assert time.monotonic() - started < 10
    finally:
        first.release()
    assert not store.exists(LEASE)
    second = RunLease(store, job_id="second-job")
    second.acquire()
    second.release()


class _IgnoresConditionalCreate:
    """A store that, like some S3-compatible servers, drops If-None-Match."""

    def __init__(self, store):
        self._store = store

    def write_bytes(self, key, data, *, if_absent=False):
        self._store.write_bytes(key, data)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_live_lease_is_refused_on_a_store_that_ignores_conditional_create(store):
    first = RunLease(store, job_id="first-job")
    first.acquire()
    try:
        with pytest.raises(LeaseHeldError, match="first-job"):
            RunLease(_IgnoresConditionalCreate(store), job_id="second-job").acquire()
        assert json.loads(store.read_bytes(LEASE))["job_id"] == "first-job"
    finally:
        first.release()


def test_live_lease_on_another_host_is_respected(store):
    _write_lease(store)
    with pytest.raises(LeaseHeldError, match="job-7 on other-host"):
        RunLease(store).acquire()


def test_lease_past_its_ttl_is_taken_over(store):
    _write_lease(store, heartbeat_time=time.time() - 120)
    lease = RunLease(store, job_id="new")
    lease.acquire()
    assert json.loads(store.read_bytes(LEASE))["job_id"] == "new"
    lease.release()


def test_lease_of_a_dead_process_on_this_host_is_taken_over(store):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lease(store, host=socket.gethostname(), pid=int(dead.stdout))
    lease = RunLease(store, job_id="new")
    lease.acquire()
    lease.release()


def test_heartbeat_refreshes_the_lease(store):
    lease = RunLease(store, ttl_s=1.5)
    lease.acquire()
    try:
        first = json.loads(store.read_bytes(LEASE))["heartbeat_time"]
        time.sleep(1.2)
        assert json.loads(store.read_bytes(LEASE))["heartbeat_time"] > first
    finally:
        lease.release()

"""The run lease on local and S3 roots: one writer at a time, stale leases taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from skylift.checkpoint.lease import LeaseHeldError, RunLease, current_holder, lease_generations, lease_key


def _write_lease(store, generation=1, **fields):
    record = {"owner": "someone", "job_id": "job-7", "host": "other-host", "pid": 4242,
              "heartbeat_time": time.time(), "ttl_s": 60.0, **fields}
    store.write_bytes(lease_key(generation), json.dumps(record).encode())


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
    assert current_holder(store)["released"]
    started = time.monotonic()
    second = RunLease(store, job_id="second-job")
    second.acquire()
    assert time.monotonic() - started < 10, "a released lease is free at once"
    assert lease_generations(store) == [2], "the winner removes the generations below its own"
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
        assert current_holder(store)["job_id"] == "first-job"
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
    assert current_holder(store)["job_id"] == "new"
    lease.release()


def test_lease_of_a_dead_process_on_this_host_is_taken_over(store):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lease(store, host=socket.gethostname(), pid=int(dead.stdout))
    lease = RunLease(store, job_id="new")
    lease.acquire()
    try:
        holder = current_holder(store)
        assert (holder["job_id"], holder["host"], holder["pid"]) == ("new", socket.gethostname(), os.getpid())
        assert not holder.get("released")
        assert lease_generations(store) == [2], "the dead holder's generation is gone, the new one above it"
    finally:
        lease.release()


def test_heartbeat_refreshes_the_lease(store):
    lease = RunLease(store, ttl_s=1.5)
    lease.acquire()
    try:
        first = current_holder(store)["heartbeat_time"]
        time.sleep(1.2)
        assert current_holder(store)["heartbeat_time"] > first
    finally:
        lease.release()


def _plant_stale_lease(store):
    """A lease whose holder stopped renewing it: taken with a tiny TTL, its heartbeat stopped."""
    dead = RunLease(store, ttl_s=0.01, job_id="dead-job")
    dead.acquire()
    dead._stop.set()
    dead._thread.join()
    time.sleep(0.02)


@pytest.mark.slow
def test_two_processes_racing_for_a_stale_lease_never_both_win(store, tmp_path):
    """Two real processes try to take over one expired lease within microseconds of each
    other, 100 times: exactly one wins each time (a read-delete-create takeover let both win)."""
    import os

    from skylift.storage import open_store
    from tests.conftest import REPO_ROOT

    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if getattr(store, "endpoint_url", None):
        environment["SKYLIFT_S3_ENDPOINT_URL"] = store.endpoint_url
    contenders = [
        subprocess.Popen([sys.executable, "-m", "tests.checkpoint.lease_contender", name], cwd=REPO_ROOT,
                         env=environment, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for name in ("job-a", "job-b")
    ]
    double, none = [], []
    try:
        for trial in range(100):
            url = f"{store.url}/trial-{trial}"
            _plant_stale_lease(open_store(url, endpoint_url=getattr(store, "endpoint_url", None)))
            start_at = time.time() + 0.05
            for contender in contenders:
                contender.stdin.write(f"{url} {start_at}\n")
                contender.stdin.flush()
            answers = [contender.stdout.readline().strip() for contender in contenders]
            assert set(answers) <= {"won", "lost"}, answers
            if answers.count("won") > 1:
                double.append(trial)
            elif answers.count("won") == 1:
                holder = current_holder(open_store(url, endpoint_url=getattr(store, "endpoint_url", None)))
                assert holder["job_id"] == ("job-a", "job-b")[answers.index("won")], f"trial {trial}"
            if answers.count("won") == 0:
                none.append(trial)
    finally:
        for contender in contenders:
            contender.stdin.close()
            contender.wait(timeout=30)
    assert double == [], f"both contenders took the lease in {len(double)} of 100 trials: {double}"
    assert none == [], f"neither contender took the stale lease in trials {none}"


def test_a_holder_paused_past_its_ttl_learns_it_lost_the_lease_and_writes_nothing(store):
    """The holder's heartbeat stops (as in a paused process) past its TTL and another job
    takes over: the holder's next check raises, and its fenced writes and deletes are refused."""
    from skylift.checkpoint.lease import FencedStore, LeaseLostError

    first = RunLease(store, ttl_s=1.0, job_id="paused-job")
    first.acquire()
    first._stop.set()  # paused: no heartbeat, no step boundary
    first._thread.join()
    store.write_bytes("step-7/manifest.json", b"{}")
    time.sleep(1.1)
    second = RunLease(store, job_id="second-job")
    second.acquire()
    try:
        with pytest.raises(LeaseLostError, match=r"taken over by job second-job .*lease_ttl_s"):
            first.check()
        fenced = FencedStore(store, first)
        with pytest.raises(LeaseLostError):
            fenced.write_bytes("step-8/model.safetensors", b"late")
        with pytest.raises(LeaseLostError):
            fenced.delete_prefix("step-7")
        assert not store.exists("step-8/model.safetensors") and store.exists("step-7/manifest.json")
        first.release()  # a lost holder leaves the new holder's lease alone
        assert current_holder(store)["job_id"] == "second-job" and not current_holder(store)["released"]
    finally:
        second.release()


def test_a_live_holder_keeps_its_lease_across_checks(store):
    lease = RunLease(store, ttl_s=1.0, job_id="busy-job")
    lease.acquire()
    try:
        for _ in range(4):
            lease.check()
            time.sleep(0.4)
        assert lease.lost is None and current_holder(store)["job_id"] == "busy-job"
    finally:
        lease.release()

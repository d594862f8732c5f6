"""Real kills, real servers: a run loses nothing and resumes bit for bit.

Every run that is killed is a subprocess of ``python -m skylift run``. Crashes are real
SIGKILLs delivered at named points (``SKYLIFT_FAULT_INJECTION``), S3 is a moto
server on 127.0.0.1, and faults come from a loopback proxy. A single-process run that is
not killed (the resume after the last kill, a run that only sets up a checkpoint, the run
under S3 faults) trains in this process (``lean_train_here``): its start is not under test,
and on one thread it equals a subprocess's run bit for bit.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from skylift.checkpoint.manifest import committed_steps, read_manifest, read_verified
from skylift.storage import open_store
from tests.checkpoint.runs import (
    LEAN,
    ONE_THREAD,
    assert_same_run,
    lean_train,
    lean_train_here,
    records,
    state_kept,
    summary,
    train_arguments,
)
from tests.servers import FaultyProxy

KILLED = -9


def _kill_plan(seed: int) -> list[str]:
    """Five kill points in increasing steps: inside training steps and inside saves."""
    rng = random.Random(seed)
    saves = list(range(7, 57, 7))
    phases = ["step_end", "during_payload", "after_payload", "after_manifest", "step_end"]
    plan, floor = [], 1
    for phase in phases:
        pool = [s for s in (saves if phase != "step_end" else range(floor, 58)) if s >= floor]
        step = rng.choice(pool[: max(1, len(pool) // 3)])
        plan.append(f"{phase}:step={step}")
        floor = step + 1
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_kill9_at_five_points_then_resume_equals_uninterrupted(backend, reference, tmp_path, request, cli_here):
    run_dir = tmp_path / "run"
    overrides, env = [], {}
    if backend == "s3":
        moto_server = request.getfixturevalue("moto_server")
        bucket = request.getfixturevalue("s3_bucket")
        overrides = [f"checkpoint.root=s3://{bucket}/run"]
        env = {"SKYLIFT_S3_ENDPOINT_URL": moto_server.endpoint_url}
    plan = _kill_plan(seed=len(backend))
    for point in plan:
        result = lean_train(run_dir, *overrides, env={**env, "SKYLIFT_FAULT_INJECTION": point})
        assert result.returncode == KILLED, f"{point} did not kill the run:\n{result.stderr[-2000:]}"
    # The resume after the last kill: in this process, as the reference ran.
    final = lean_train_here(cli_here, run_dir, *overrides, env=env)
    assert final.returncode == 0, final.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] is not None
    assert_same_run(run_dir, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_rank_dying_mid_write_keeps_the_previous_commit(reference_ddp, tmp_path):
    run_dir = tmp_path / "run"
    crashed = lean_train(run_dir, "preemption.grace_s=5", nproc=2,
                         env={"SKYLIFT_FAULT_INJECTION": "after_payload:step=14:rank=1"})
    assert crashed.returncode != 0
    store = open_store(str(run_dir / "checkpoints"))
    assert committed_steps(store) == [7], "the torn step-14 must not be committed"
    resumed = lean_train(run_dir, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 7
    assert summary(run_dir)["replicas_agree"] is True
    assert_same_run(run_dir, reference_ddp)


@pytest.mark.slow
def test_corrupt_newest_checkpoint_is_skipped_and_explicit_resume_refuses(tmp_path, cli_here):
    run_dir = tmp_path / "run"
    assert lean_train_here(cli_here, run_dir, "schedule.max_steps=30").returncode == 0
    store = open_store(str(run_dir / "checkpoints"))
    assert committed_steps(store)[-2:] == [28, 30]
    model_file = run_dir / "checkpoints" / "step-30" / "model.safetensors"
    data = bytearray(model_file.read_bytes())
    data[-5] ^= 0x01
    model_file.write_bytes(bytes(data))

    # The two resumes in this process: what they read, refuse and say is under test, not a
    # process start (nothing is killed here).
    with state_kept():
        explicit = cli_here(*train_arguments(run_dir, "schedule.max_steps=40",
                                             f"checkpoint.resume={run_dir / 'checkpoints' / 'step-30'}", lean=True))
    assert explicit.returncode == 1
    assert "step-30/model.safetensors does not match the manifest" in explicit.stderr

    with state_kept():
        auto = cli_here(*train_arguments(run_dir, "schedule.max_steps=40", lean=True))
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "skipping checkpoint" in auto.stderr and "step-30" in auto.stderr
    assert summary(run_dir)["resumed_from_step"] == 28


@pytest.mark.slow
def test_second_run_on_the_same_root_is_refused_while_the_first_holds_the_lease(tmp_path, cli_here):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    root = tmp_path / "shared-root"
    args = ["run", "examples/quickstart.yaml", "--set", f"checkpoint.root={root}", "--set", "schedule.epochs=400",
            "--set", "monitor.tensorboard=false", "--no-doctor"]
    args += [arg for override in LEAN for arg in ("--set", override)]
    # One thread: the holder trains until it is killed, on one core, beside the runs it blocks.
    first = subprocess.Popen([sys.executable, "-m", "skylift", *args, "--set", f"run_dir={first_dir}"], cwd=REPO_ROOT,
                             env={**os.environ, **ONE_THREAD}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while not any((root / "lease").glob("*.json")):
            if first.poll() is not None:  # raises, not asserts: a poll is not a check that passed
                raise AssertionError(first.stderr.read())
            if time.monotonic() >= deadline:
                raise AssertionError("the first run took no lease within 120 s")
            time.sleep(0.2)
        started = time.monotonic()
        # The second and third runs in this process (another pid, as another process has): the
        # lease's answer is under test, not their start-up.
        with state_kept():
            second = cli_here(*args, "--set", f"run_dir={second_dir}")
        assert second.returncode == 1
        assert "run owned by job" in second.stderr and f"pid {first.pid}" in second.stderr
        assert time.monotonic() - started < 30
        assert first.poll() is None, "the first run must be untouched"
    finally:
        first.kill()
        first.wait()
    # The holder is dead (same host, its pid is gone): the lease is stale and taken over.
    with state_kept():
        third = cli_here(*args, "--set", f"run_dir={second_dir}", "--set", "schedule.max_steps=5",
                         "--set", "schedule.warmup_steps=0")
    assert third.returncode == 0, third.stderr[-2000:]
    assert "taking over a stale lease" in third.stderr


@pytest.mark.slow
def test_s3_faults_and_a_server_restart_mid_run_lose_nothing(reference, moto_server, s3_bucket, tmp_path, cli_here):
    proxy = FaultyProxy(moto_server.port)
    run_dir = tmp_path / "run"

    def inject():
        while proxy.requests_seen < 12:
            time.sleep(0.01)
        proxy.fail(2, 503)
        proxy.fail(1, 500)
        while proxy.requests_seen < 30:
            time.sleep(0.01)
        proxy.drop(2)
        while proxy.requests_seen < 45:
            time.sleep(0.01)
        moto_server.restart_after(1.5).join()

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    try:
        # In this process: the retries are under test, not a process start.
        result = lean_train_here(cli_here, run_dir, f"checkpoint.root=s3://{s3_bucket}/run",
                                 env={"SKYLIFT_S3_ENDPOINT_URL": proxy.endpoint_url})
        injector.join(timeout=30)
    finally:
        proxy.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert proxy.faults_injected == 5
    assert "retry" in result.stderr
    assert all(record["committed"] for record in records(run_dir, "checkpoint"))
    store = open_store(f"s3://{s3_bucket}/run", endpoint_url=moto_server.endpoint_url)
    for step in committed_steps(store):
        read_verified(store, step, read_manifest(store, step))
    assert_same_run(run_dir, reference)

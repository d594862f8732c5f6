"""A checkpoint root that is lost, full or unreachable: the run never reports a success it
did not have, and says which checkpoint stands.

Real faults only: a holder process paused with SIGSTOP past its lease, a real full tmpfs
(mounting one needs root; skipped otherwise), an S3 endpoint whose listener is closed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from skylift.checkpoint.lease import RunLease, current_holder
from skylift.checkpoint.manifest import committed_steps
from skylift.storage import open_store
from tests.checkpoint.runs import LEAN, ONE_THREAD, lean_train_here, records, summary
from tests.conftest import REPO_ROOT


def _files(root) -> set[str]:
    """Every file under the root but the lease's, temporary files included."""
    return {str(path.relative_to(root)) for path in root.rglob("*") if path.is_file() and path.parts[-2] != "lease"}


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a real tmpfs of ``size_bytes`` (needs root; the test is skipped otherwise)."""
    mounted = []

    def mount(name: str, size_bytes: int):
        mount_point = tmp_path / name
        mount_point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mount_point)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(mount_point)
        return mount_point

    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.slow
def test_a_holder_paused_past_its_lease_stops_at_its_next_step_without_writing(tmp_path):
    """SIGSTOP a training job past its lease TTL, let another job take the root over, SIGCONT
    it: it exits 1 naming the new holder, and writes nothing more to the root."""
    root, run_dir = tmp_path / "root", tmp_path / "paused-run"
    args = ["run", "examples/quickstart.yaml", "--no-doctor", "--set", f"checkpoint.root={root}",
            "--set", f"run_dir={run_dir}", "--set", "schedule.epochs=400", "--set", "checkpoint.lease_ttl_s=2",
            "--set", "checkpoint.every_steps=40", "--set", "checkpoint.every_minutes=null",
            "--set", "monitor.tensorboard=false"]
    args += [arg for override in LEAN for arg in ("--set", override)]
    holder = subprocess.Popen([sys.executable, "-m", "skylift", *args], cwd=REPO_ROOT,
                              env={**os.environ, **ONE_THREAD, "PYTHONUNBUFFERED": "1"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    store = open_store(str(root))
    try:
        deadline = time.monotonic() + 180
        while True:  # stopped between saves: every step folder committed, no temporary file
            if holder.poll() is not None:
                raise AssertionError(holder.stderr.read())
            if time.monotonic() >= deadline:
                raise AssertionError("the holder committed no checkpoint within 180 s")
            if committed_steps(store):
                holder.send_signal(signal.SIGSTOP)
                folders = {path.name for path in root.glob("step-*")}
                if folders == {f"step-{step}" for step in committed_steps(store)} and not any(
                        ".skylift-tmp-" in name for name in _files(root)):
                    break
                holder.send_signal(signal.SIGCONT)
            time.sleep(0.2)
        before, committed = _files(root), committed_steps(store)
        time.sleep(2.5)  # past the holder's lease_ttl_s
        second = RunLease(store, job_id="second-job")
        second.acquire()  # what a second job does first: the stale lease is taken over
        try:
            holder.send_signal(signal.SIGCONT)
            code = holder.wait(timeout=60)
            stderr = holder.stderr.read()
            assert code == 1, stderr[-3000:]
            assert "taken over by job second-job" in stderr and "stopped at step" in stderr, stderr[-3000:]
            assert "Traceback" not in stderr, stderr[-3000:]
            assert committed_steps(store) == committed
            assert _files(root) == before, "the paused holder wrote to the root after losing its lease"
            assert current_holder(store)["job_id"] == "second-job"
        finally:
            second.release()
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
            holder.wait()


@pytest.mark.slow
def test_disk_full_at_the_checkpoint_root_ends_the_run_not_successful(tmpfs, tmp_path, cli_here):
    """Every save after the second fails for space, the final one too: exit 1, a line naming
    the final step and the newest committed one, and everything else written."""
    from tests.checkpoint.test_faults import _checkpoint_bytes

    root = tmpfs("small-root", int(_checkpoint_bytes(1) * 2.5) // 4096 * 4096)
    run_dir = tmp_path / "run"
    result = lean_train_here(cli_here, run_dir, f"checkpoint.root={root}", "checkpoint.keep=2",
                             "checkpoint.on_failure=continue")
    assert result.returncode == 1, result.stderr[-3000:]
    assert committed_steps(open_store(str(root))) == [7, 14]
    line = [text for text in result.stderr.splitlines() if "final state" in text]
    assert line and "step 60" in line[0] and "no space left" in line[0].lower(), result.stderr[-3000:]
    assert "newest committed checkpoint is step 14" in line[0]
    assert "Traceback" not in result.stderr
    assert summary(run_dir)["steps"] == 60 and (run_dir / "model.safetensors").exists()


def test_a_full_run_folder_ends_with_a_clear_line_not_a_traceback(tmpfs, tmp_path, cli_here):
    """The run folder holds the metrics but not the final model: exit 1, a line naming the
    model's path and the newest committed checkpoint, and no torn model file left."""
    run_dir = tmpfs("small-run", 64 * 1024)
    root = tmp_path / "root"
    result = lean_train_here(cli_here, run_dir, f"checkpoint.root={root}", "monitor.log_every_steps=20")
    assert result.returncode == 1, result.stderr[-3000:]
    line = [text for text in result.stderr.splitlines() if "could not write the final model" in text]
    assert line and "newest committed checkpoint is step 60" in line[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (run_dir / "model.safetensors").exists()


@pytest.mark.slow
def test_a_store_that_stays_unreachable_stops_the_run_naming_the_last_commit(moto_server, s3_bucket, tmp_path,
                                                                              cli_here):
    """After the first commit the S3 endpoint answers nothing (every connection is dropped
    unanswered, as by a dead server): past checkpoint.unreachable_limit_s the run stops,
    exit 1, with a line naming the newest committed step, instead of paying every due
    save's retry budget."""
    from tests.servers import FaultyProxy

    proxy = FaultyProxy(moto_server.port)
    run_dir = tmp_path / "run"
    direct = open_store(f"s3://{s3_bucket}/run", endpoint_url=moto_server.endpoint_url)

    def close_after_the_first_commit() -> None:
        deadline = time.monotonic() + 120
        # After the commit's bookkeeping too (LATEST names it): a store lost between the
        # manifest and LATEST is another case (the manager's, not this test's).
        while time.monotonic() < deadline:
            steps = committed_steps(direct)
            if steps and direct.exists("LATEST") and direct.read_bytes("LATEST").decode().strip() == f"step-{steps[-1]}":
                break
            time.sleep(0.01)
        proxy.drop_every()  # pooled keep-alive connections too: closing the listener would spare them

    closer = threading.Thread(target=close_after_the_first_commit, daemon=True)
    closer.start()
    started = time.monotonic()
    result = lean_train_here(cli_here, run_dir, f"checkpoint.root=s3://{s3_bucket}/run",
                             f"checkpoint.endpoint_url={proxy.endpoint_url}", "schedule.max_steps=2000",
                             "schedule.epochs=400", "checkpoint.unreachable_limit_s=1", "checkpoint.every_steps=7")
    elapsed_s = time.monotonic() - started
    closer.join(timeout=5)
    newest = committed_steps(direct)[-1]
    assert result.returncode == 1, result.stderr[-3000:]
    line = [text for text in result.stderr.splitlines() if "unreachable for" in text and text.startswith("skylift")]
    assert line and "checkpoint.unreachable_limit_s" in line[0], result.stderr[-3000:]
    assert f"newest committed checkpoint is step {newest}" in line[0], line[0]
    assert "Traceback" not in result.stderr
    failed = [record for record in records(run_dir, "checkpoint") if not record["committed"]]
    assert 1 <= len(failed) <= 2, failed
    assert elapsed_s < 150, f"the run took {elapsed_s:.0f} s to stop"
    proxy.close()

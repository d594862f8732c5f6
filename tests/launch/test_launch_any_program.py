"""``skylift launch`` runs any program as plain torchrun would, and better: the script's
folder on ``sys.path``, workers that die with the launcher, the cloud's notice as SIGTERM.

Real processes throughout: ``skylift launch --nproc 2`` on the unchanged
``programs/plain_job.py`` (no skylift import), the loopback AWS metadata server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from skylift.errors import EXIT_REQUEUE
from tests.cloud.metadata_server import MetadataServer
from tests.conftest import REPO_ROOT
from tests.process_family import ProcessFamily

PROGRAMS = Path(__file__).parent / "programs"
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens


def _environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _launch(folder: Path, *args: str, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    logs = (folder / "launch.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "skylift", "launch", "--nproc", "2", "--no-doctor", "--",
         "python", str(PROGRAMS / "plain_job.py"), str(folder), *args],
        cwd=cwd, env=env, stdout=logs, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )


def _wait_for(condition, what: str, process: subprocess.Popen, folder: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what}:\n{(folder / 'launch.log').read_text()[-3000:]}")
        time.sleep(0.05)


def _workers_started(folder: Path) -> bool:
    return all((folder / f"step{rank}").exists() for rank in range(2))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_script_imports_its_sibling_from_another_folder(tmp_path):
    """``python dir/script.py`` has ``dir`` on sys.path; so has every worker (was: ModuleNotFoundError)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    process = _launch(tmp_path, "3", env=_environment(PYTHONPATH=os.environ.get("PYTHONPATH", "")), cwd=elsewhere)
    assert process.wait(120) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    assert [(tmp_path / f"step{rank}").read_text() for rank in range(2)] == ["3", "3"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_kill_9_of_the_launchers_group_leaves_no_worker_alive(tmp_path):
    process = _launch(tmp_path, env=_environment(), cwd=REPO_ROOT)
    family = ProcessFamily(process)
    try:
        _wait_for(lambda: _workers_started(tmp_path), "workers never started", process, tmp_path)
        workers = [psutil.Process(int((tmp_path / f"pid{rank}").read_text())) for rank in range(2)]
        family.remember_family()
        os.killpg(process.pid, signal.SIGKILL)  # the launcher's group; torchrun's workers are in their own
        process.wait(10)
        _gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers still running after the launcher was killed: {alive}"
        steps = [(tmp_path / f"step{rank}").read_text() for rank in range(2)]
        time.sleep(0.5)
        assert [(tmp_path / f"step{rank}").read_text() for rank in range(2)] == steps  # none trains on
    finally:
        family.kill()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_aws_notice_reaches_a_plain_script_as_sigterm_and_the_launch_exits_143(tmp_path):
    with MetadataServer() as server:
        process = _launch(tmp_path, env=_environment(SKYLIFT_CLOUD="aws", SKYLIFT_METADATA_ENDPOINT=server.url),
                          cwd=REPO_ROOT)
        family = ProcessFamily(process)
        try:
            _wait_for(lambda: _workers_started(tmp_path), "workers never started", process, tmp_path)
            server.arm("aws", deadline_in_s=90)
            code = process.wait(60)  # AWS is polled every 5 s
            log = (tmp_path / "launch.log").read_text()
            assert code == EXIT_REQUEUE, log[-3000:]
        finally:
            family.kill()
    # Each rank's SIGTERM handler saved, then the script ended as it does (0): the launch says "requeue".
    assert all(int((tmp_path / f"saved{rank}").read_text()) > 0 for rank in range(2)), log
    assert "spot-termination notice" in log and "SIGTERM to 2 worker(s)" in log, log
    # The grace was the notice's own (about 90 s from the armed deadline), not a fixed window.
    [line] = [line for line in log.splitlines() if "SIGTERM to 2 worker(s)" in line]
    grace_s = float(line.split(" s left")[0].rsplit(" ", 1)[-1])
    assert 75 <= grace_s <= 91, line


def test_a_skylift_worker_reads_the_relayed_notice_on_sigterm(tmp_path, monkeypatch):
    """The launcher writes the notice before its SIGTERM; watch_signals reports the cloud's deadline."""
    from skylift.cloud.notice import RELAYED_NOTICE_VARIABLE, watch_signals

    deadline_s = time.time() + 77.0
    notice_file = tmp_path / "notice.json"
    notice_file.write_text(json.dumps({"cloud": "aws", "kind": "spot-termination", "detail": "terminate",
                                       "received_at_s": time.time(), "deadline_s": deadline_s}))
    monkeypatch.setenv(RELAYED_NOTICE_VARIABLE, str(notice_file))
    heard = []
    restore = watch_signals(heard.append, (signal.SIGTERM,), grace_s=5.0)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    finally:
        restore()
    [notice] = heard
    assert (notice.cloud, notice.kind, notice.deadline_s) == ("aws", "spot-termination", deadline_s)
    notice_file.unlink()  # no relayed notice: a plain SIGTERM with the given grace
    restore = watch_signals(heard.append, (signal.SIGTERM,), grace_s=5.0)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    finally:
        restore()
    assert heard[1].kind == "signal" and abs(heard[1].seconds_left() - 5.0) < 1.0


def test_a_console_script_that_is_not_python_is_refused_in_one_line(cli_here, tmp_path):
    result = cli_here("launch", "--nproc", "2", "--", "ls", "-l")
    assert result.returncode == 2
    assert "is not a Python console script" in result.stderr and "Traceback" not in result.stderr
    result = cli_here("launch", "--nproc", "2", "--", "no-such-program-anywhere")
    assert result.returncode == 2 and "neither a script nor a command on the PATH" in result.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_second_launch_on_the_same_checkpoint_root_is_refused_in_one_line(tmp_path, cli):
    root = tmp_path / "root"
    first = subprocess.Popen(
        [sys.executable, "-m", "skylift", "launch", "--nproc", "2", "--no-doctor", "--checkpoint-root", str(root),
         "--", "python", str(PROGRAMS / "plain_job.py"), str(tmp_path)],
        cwd=REPO_ROOT, env=_environment(), stdout=(tmp_path / "launch.log").open("w"), stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )
    family = ProcessFamily(first)
    try:
        _wait_for(lambda: _workers_started(tmp_path), "workers never started", first, tmp_path)
        second = cli("launch", "--nproc", "2", "--no-doctor", "--checkpoint-root", str(root), "--",
                     "python", str(PROGRAMS / "plain_job.py"), str(tmp_path / "second"), env=_environment())
    finally:
        family.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    assert "Traceback" not in second.stderr and not (tmp_path / "second").exists()
    [line] = [line for line in second.stderr.splitlines() if "is in use" in line]
    assert f"checkpoint root {root} is in use" in line and "run owned by job skylift-launch-" in line


def test_a_skylift_worker_joins_its_launchers_lease_and_a_stranger_is_refused(tmp_path, monkeypatch):
    from skylift.checkpoint.lease import LAUNCH_LEASE_VARIABLE, LeaseHeldError, RunLease, current_holder
    from skylift.launch.run_lease import take_launch_lease
    from skylift.storage import open_store

    launcher_lease, variables = take_launch_lease(str(tmp_path))
    try:
        with pytest.raises(LeaseHeldError, match="run owned by job skylift-launch-"):
            RunLease(open_store(str(tmp_path))).acquire()  # a job that is not this launcher's
        monkeypatch.setenv(LAUNCH_LEASE_VARIABLE, variables[LAUNCH_LEASE_VARIABLE])
        worker_lease = RunLease(open_store(str(tmp_path)))
        worker_lease.acquire()  # the Runtime inside a launched worker: joins
        worker_lease.check()
        worker_lease.release()  # leaves the launcher's lease as it was
        holder = current_holder(open_store(str(tmp_path)))
        assert holder["owner"] == launcher_lease.owner and not holder["released"]
    finally:
        launcher_lease.release()
    assert current_holder(open_store(str(tmp_path)))["released"]

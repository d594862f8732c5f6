"""A real run folder with a preemption and a resume, and the Chromium the report is checked in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.monitor.browser import chromium_path

MAX_STEPS = 60
SIGTERM_AFTER_STEP = 3
"""Early, so that the stop lands mid-run even when steps take a few milliseconds."""
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: the runs never reach a real metadata service
OVERRIDES = (
    "precision=fp32",
    f"schedule.max_steps={MAX_STEPS}",
    "checkpoint.every_steps=10",
    "checkpoint.every_minutes=null",
    "preemption.poll_interval_s=0.05",
    "preemption.grace_s=20",
    "monitor.log_every_steps=1",
    "monitor.tensorboard=false",
)
MONITOR_OVERRIDES = {"usd_per_hour": "3.0", "system_interval_s": "0.2", "breakdown_every_steps": "2", "report": "false"}
"""So the real run writes cost, system and breakdown records too
(and leaves the report to the test's own ``skylift report``)."""


def _command(run_dir: Path) -> list[str]:
    overrides = [*OVERRIDES, *(f"monitor.{k}={v}" for k, v in MONITOR_OVERRIDES.items())]
    command = [sys.executable, "-m", "skylift", "run", "examples/quickstart.yaml", "--json", "--set", f"run_dir={run_dir}"]
    for override in overrides:
        command += ["--set", override]
    return command


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
    # One thread: on two shared cores two OpenMP threads wait on each other at every operator.
    env.update(PYTHONUNBUFFERED="1", SKYLIFT_METADATA_ENDPOINT=DEAD_ENDPOINT, OMP_NUM_THREADS="1")
    return env


def _train_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("kind") == "train":
            steps.append(record["step"])
    return steps


def _run(run_dir: Path, log: Path, *, sigterm_after_step: int | None, timeout_s: float = 240) -> int:
    """``skylift run`` in its own session; SIGTERM once a step is logged; return the exit code."""
    with log.open("w") as output:
        process = subprocess.Popen(_command(run_dir), cwd=REPO_ROOT, env=_environment(), stdout=output,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        signalled = sigterm_after_step is None
        while process.poll() is None and time.monotonic() < deadline:
            if not signalled and max(_train_steps(run_dir), default=0) >= sigterm_after_step:
                process.send_signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.02)
        return process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Fits in this process (the diagnosis and schema runs) on one thread. On two cores shared
    with other jobs two OpenMP threads wait on each other at every operator: a quickstart step
    measured 78 ms on one thread and 816 ms on two, and the slow loader's run, on two threads
    beside other tests, measured a data wait of 21% of the step (its diagnosis needs 25%)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def preempted_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A digits run stopped by SIGTERM mid-way (exit 143), then resumed to the end (exit 0)."""
    root = tmp_path_factory.mktemp("preempted")
    run_dir = root / "run"
    code = _run(run_dir, root / "attempt-1.log", sigterm_after_step=SIGTERM_AFTER_STEP)
    assert code == 143, f"expected a preemption exit (143), got {code}:\n{(root / 'attempt-1.log').read_text()[-3000:]}"
    code = _run(run_dir, root / "attempt-2.log", sigterm_after_step=None)
    assert code == 0, f"the resume failed ({code}):\n{(root / 'attempt-2.log').read_text()[-3000:]}"
    assert max(_train_steps(run_dir)) == MAX_STEPS
    return run_dir


@pytest.fixture(scope="session")
def chromium() -> str:
    """Chromium's path. Missing: a failure under CI (the browser check is the point), else a skip.

    ``CI`` is set by CI services; ``.ci/run`` sets ``SKYLIFT_REQUIRE_CHROMIUM``.
    """
    path = chromium_path()
    if path is None:
        message = "Chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
        required_by = [name for name in ("CI", "SKYLIFT_REQUIRE_CHROMIUM") if os.environ.get(name)]
        if required_by:
            pytest.fail(f"{' and '.join(required_by)} set and {message}")
        pytest.skip(message)
    return path

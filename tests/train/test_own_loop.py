"""A user's own loop on the Runtime (``examples/own_loop.py``), in real torchrun processes.

Every run is ``python -m skylift launch --nproc 2 -- python examples/own_loop.py`` with
fp32 and deterministic kernels, so a resumed run must equal the uninterrupted one bit
for bit: every logged per-step loss and the final weights. Kills are real SIGKILLs at
named points (``SKYLIFT_FAULT_INJECTION``); the spot notice comes from a loopback
metadata server speaking AWS's IMDSv2.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest

from skylift.errors import EXIT_REQUEUE
from tests.checkpoint.runs import Background, assert_same_run, records
from tests.cloud.metadata_server import MetadataServer
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.multiprocess

STEPS = 44  # 2 epochs of 1,437 digits in global batches of 8 x 2 ranks x 4 micro-steps (22 a epoch)
EVERY_STEPS = 5
OVERRIDES = (
    "precision=fp32",
    "deterministic=true",
    "schedule.epochs=2",
    f"checkpoint.every_steps={EVERY_STEPS}",
    "checkpoint.every_minutes=null",
    "monitor.log_every_steps=1",
    "monitor.tensorboard=false",
    "preemption.poll_interval_s=0.05",
    "preemption.grace_s=20",
)
DEAD_ENDPOINT = "http://127.0.0.1:9"  # nothing listens: no notice, and nothing leaves the machine


def _environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}
    return {**env, "PYTHONUNBUFFERED": "1", "SKYLIFT_METADATA_ENDPOINT": DEAD_ENDPOINT, **extra}


def _command(run_dir, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "skylift", "launch", "--nproc", str(nproc), "--", "python",
            "examples/own_loop.py", "examples/own_loop.yaml", f"run_dir={run_dir}", *OVERRIDES]


def _launch(run_dir, env: dict[str, str], nproc: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(_command(run_dir, nproc), cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


class _Reference:
    """The uninterrupted job, started when first asked for and trained beside the test's own
    jobs (their start-ups and steps overlap on the two cores); :meth:`get` waits for it."""

    def __init__(self, run_dir) -> None:
        self.run_dir = run_dir
        self.job = Background(_command(run_dir), env=_environment())
        self._checked = False

    def get(self):
        if not self._checked:
            result = self.job.result()
            assert result.returncode == 0, result.stderr[-3000:]
            steps = [record["step"] for record in records(self.run_dir, "train")]
            assert steps == list(range(1, STEPS + 1)), steps
            self._checked = True
        return self.run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    reference = _Reference(tmp_path_factory.mktemp("own-loop-reference") / "run")
    with reference.job:
        yield reference


def _kill_plan(seed: int) -> list[str]:
    """A kill at a step boundary, one inside a checkpoint's payload write, one in the second epoch."""
    rng = random.Random(seed)
    first = rng.randrange(3, 12)
    during = rng.choice([step for step in range(EVERY_STEPS, 22, EVERY_STEPS) if step > first])
    late = rng.randrange(24, STEPS - 2)
    return [f"step_end:step={first}:rank=1", f"during_payload:step={during}:rank=0", f"step_end:step={late}"]


@pytest.mark.slow
def test_kill9_at_three_points_then_resume_equals_uninterrupted(reference, tmp_path):
    run_dir = tmp_path / "run"
    for point in _kill_plan(seed=12):
        result = _launch(run_dir, _environment(SKYLIFT_FAULT_INJECTION=point))
        assert result.returncode != 0, f"{point} did not kill the job:\n{result.stderr[-2000:]}"
        assert (run_dir / "metrics.jsonl").exists()
    final = _launch(run_dir, _environment())
    assert final.returncode == 0, final.stderr[-3000:]
    starts = records(run_dir, "run_start")
    assert len(starts) == 4 and all(start["resumed_from_step"] for start in starts[1:]), starts
    assert_same_run(run_dir, reference.get())  # every step's loss and the final weights, bit for bit


@pytest.mark.slow
def test_aws_spot_notice_commits_before_the_deadline_exits_143_and_resumes_exactly(reference, tmp_path):
    run_dir = tmp_path / "run"
    with MetadataServer() as server:
        env = _environment(SKYLIFT_CLOUD="aws", SKYLIFT_METADATA_ENDPOINT=server.url)
        job = subprocess.Popen(_command(run_dir), cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_step(run_dir, 8, job)
            deadline_s = server.arm("aws", deadline_in_s=90)
            _, stderr = job.communicate(timeout=240)
        finally:
            if job.poll() is None:
                job.kill()
        assert job.returncode == EXIT_REQUEUE, stderr[-3000:]
        assert server.count("PUT", "/latest/api/token") > 0  # IMDSv2: a token before every read
        assert all(request.status in (200, 404) for request in server.requests), server.requests
    (notice,) = records(run_dir, "preemption")
    assert notice["saved"] is True and notice["checkpoint_step"] == notice["step"], notice
    assert notice["time"] < deadline_s
    assert (run_dir / "checkpoints" / f"step-{notice['step']}" / "manifest.json").exists()
    final = _launch(run_dir, _environment())
    assert final.returncode == 0, final.stderr[-3000:]
    assert records(run_dir, "run_start")[-1]["resumed_from_step"] == notice["step"]
    assert_same_run(run_dir, reference.get())


def _wait_for_step(run_dir, step: int, job: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if job.poll() is not None:  # a raise, not an assert: a poll is not a check that passed
            raise AssertionError(f"the job ended before step {step}: {job.stderr.read()[-2000:]}")
        if (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in _train_so_far(run_dir)):
            return
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout_s} s")


def _train_so_far(run_dir) -> list[dict]:
    import json

    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "train":
            out.append(record)
    return out


@pytest.mark.slow
def test_a_runtime_run_folder_renders_a_report_and_the_live_view(reference, capsys, monkeypatch):
    # `skylift report` and `skylift monitor --once` in this process: what they make of the
    # run folder is under test, not a process start (the run itself was real processes).
    from skylift.cli.main import main

    reference = reference.get()
    monkeypatch.chdir(REPO_ROOT)
    capsys.readouterr()
    code = main(["report", str(reference), "--json"])
    result = capsys.readouterr()
    assert code == 0, result.err[-2000:]
    assert (reference / "report" / "index.html").stat().st_size > 0
    train = records(reference, "train")
    assert any("breakdown_s" in record for record in train) and all("mfu" in record for record in train)
    assert records(reference, "run_end") and records(reference, "diagnosis")
    monkeypatch.setenv("COLUMNS", "120")
    code = main(["monitor", str(reference), "--once"])
    live = capsys.readouterr()
    assert code == 0, live.err[-2000:]
    assert f"{STEPS} / {STEPS}" in live.out and "finished" in live.out

"""Preemption end to end: a spot notice from each cloud's metadata server, or SIGTERM.

Real ``python -m skylift run`` subprocesses and a real loopback HTTP metadata server
(:mod:`tests.cloud.metadata_server`, 127.0.0.1 only). Each case checks that

* the run stops mid-way with the requeue exit code (143),
* ``metrics.jsonl`` holds one ``preemption`` record: saved, at the step the run
  stopped at, committed sooner than the notice's deadline,
* ``step-N/manifest.json`` exists and every file it lists verifies (sha256),
* running the same command again resumes from that step, exits 0, and ends with
  weights and per-step losses bitwise equal to an uninterrupted run.

The preempted runs are subprocesses (the signal, the exit code 143 and the metadata
server read at start-up are a process's). A single-process run that is neither signalled
nor noticed (the uninterrupted reference, the resume that follows a stop) runs in this
process (:func:`_run_here`) under exactly the environment its subprocess would get: its
start is not under test, and on one thread it equals the subprocess's run bit for bit.

Every subprocess points ``SKYLIFT_METADATA_ENDPOINT`` at 127.0.0.1 (the fake server,
or a port where nothing listens), so nothing here can reach a real metadata address.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from skylift.checkpoint.manifest import read_manifest, read_verified
from skylift.cloud.vendors import cloud_names
from skylift.errors import EXIT_REQUEUE
from skylift.launch.preloaded_workers import WORKER_NAME_PREFIX
from skylift.storage import open_store
from tests.checkpoint.runs import LEAN, ONE_THREAD, run_here, state_kept
from tests.cloud.metadata_server import MetadataServer
from tests.conftest import REPO_ROOT
from tests.process_family import ProcessFamily

QUICKSTART = "examples/quickstart.yaml"
MAX_STEPS = 80
EVERY_STEPS = 25
"""Periodic saves at 25, 50, 75: the notice is armed after step 25's save, so the stop
lands between two periodic saves and the emergency save is the one that counts (and
it is sized with a measured save time, not the first-save guess)."""
ARM_AFTER_STEP = EVERY_STEPS + 2
GRACE_S = 20.0
NOTICE_LEAD_S = 90
"""The armed deadline: far enough to save, and unlike every cloud's fallback window
(30, 120, 300 s), so a deadline the client failed to parse shows."""
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens
RUN_TIMEOUT_S = 300.0

# fp32 and deterministic kernels: a resumed run must equal the uninterrupted one bit
# for bit. The same overrides go to the reference and to the interrupted runs.
OVERRIDES = (
    "precision=fp32",
    "deterministic=true",
    f"schedule.max_steps={MAX_STEPS}",
    f"checkpoint.every_steps={EVERY_STEPS}",
    "checkpoint.every_minutes=null",
    "preemption.poll_interval_s=0.05",
    f"preemption.grace_s={GRACE_S}",
    "monitor.log_every_steps=1",
    "monitor.tensorboard=false",
)


# -- processes ---------------------------------------------------------------------


def _environment(cloud: str | None = None, endpoint: str = DEAD_ENDPOINT) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
    env.update(PYTHONUNBUFFERED="1", SKYLIFT_METADATA_ENDPOINT=endpoint)
    if cloud is not None:
        env["SKYLIFT_CLOUD"] = cloud
    return env


def _command(run_dir: Path, nproc: int, overrides: tuple[str, ...] = ()) -> list[str]:
    # --no-doctor and LEAN (no HTML report): half a quickstart run's fixed cost, and
    # neither is part of stopping, saving or resuming.
    args = [sys.executable, "-m", "skylift", "run", QUICKSTART, "--json", "--no-doctor", "--set", f"run_dir={run_dir}"]
    for override in (*OVERRIDES, *LEAN, *overrides):
        args += ["--set", override]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    return args


class Run(ProcessFamily):
    """``skylift run`` in a subprocess, with its output in files and its whole
    process tree (torchrun's workers live in sessions of their own) killed on exit."""

    def __init__(self, run_dir: Path, *, nproc: int = 1, env: dict[str, str], overrides: tuple[str, ...] = ()) -> None:
        self.run_dir = run_dir
        self.nproc = nproc
        run_dir.mkdir(parents=True, exist_ok=True)
        self._logs = run_dir.parent / f"{run_dir.name}.logs"
        self._logs.mkdir(exist_ok=True)
        attempt = len(list(self._logs.glob("stdout-*")))
        self._stdout_path = self._logs / f"stdout-{attempt}"
        self._stderr_path = self._logs / f"stderr-{attempt}"
        if nproc == 1:
            env = {**ONE_THREAD, **env}  # as every single-process run compared bitwise (tests.checkpoint.runs)
        with self._stdout_path.open("w") as stdout, self._stderr_path.open("w") as stderr:
            super().__init__(subprocess.Popen(
                _command(run_dir, nproc, overrides), cwd=REPO_ROOT, env=env, stdout=stdout, stderr=stderr,
                stdin=subprocess.DEVNULL, start_new_session=True,
            ))
        self.returncode: int | None = None

    @property
    def stdout(self) -> str:
        return self._stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self._stderr_path.read_text(errors="replace")

    def explain(self) -> str:
        return f"exit code {self.popen.poll()}\n--- stderr (tail) ---\n{self.stderr[-4000:]}"

    def wait_for_step(self, step: int, timeout_s: float = RUN_TIMEOUT_S) -> int:
        """Block until a ``train`` record for ``step`` (or later) is on disk; return it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.remember_family(every_s=0.5)
            latest = _latest_train_step(self.run_dir)
            if latest >= step:
                return latest
            if self.popen.poll() is not None:  # a raise, not an assert: a poll is not a check that passed
                raise AssertionError(f"the run ended before step {step}: {self.explain()}")
            time.sleep(0.01)
        raise AssertionError(f"no train record for step {step} within {timeout_s} s: {self.explain()}")

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        deadline = time.monotonic() + timeout_s
        while self.popen.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"the run did not finish within {timeout_s} s: {self.explain()}")
            self.remember_family(every_s=0.5)
            time.sleep(0.05)
        self.returncode = self.popen.returncode
        return self.returncode


@contextmanager
def running(run_dir: Path, *, nproc: int = 1, env: dict[str, str], overrides: tuple[str, ...] = ()) -> Iterator[Run]:
    run = Run(run_dir, nproc=nproc, env=env, overrides=overrides)
    try:
        yield run
    finally:
        run.kill()


def _run_here(run_dir: Path, *, env: dict[str, str], overrides: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """:class:`Run`'s single-process command in this process, with ``os.environ`` exactly
    ``env`` (what the subprocess would get; put back afterwards) and one thread (as
    :data:`ONE_THREAD` gives the subprocess)."""
    with state_kept():
        os.environ.clear()
        os.environ.update(env)
        return run_here(*_command(run_dir, 1, overrides)[3:])  # less `python -m skylift`


def train_to_end(run_dir: Path, *, nproc: int = 1, env: dict[str, str], overrides: tuple[str, ...] = ()) -> Run:
    """Run to the end; fail unless it exits 0."""
    with running(run_dir, nproc=nproc, env=env, overrides=overrides) as run:
        assert run.wait() == 0, run.explain()
    return run


# -- run folders ---------------------------------------------------------------------


def _records(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written right now
            continue
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records


def _latest_train_step(run_dir: Path) -> int:
    return max((record["step"] for record in _records(run_dir, "train")), default=0)


def _losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last loss written for each step."""
    return {record["step"]: record["loss"] for record in _records(run_dir, "train")}


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@dataclass(frozen=True)
class Reference:
    run_dir: Path
    losses: dict[int, float]
    weights: dict[str, torch.Tensor]


def _reference_in(run_dir: Path) -> Reference:
    """An uninterrupted run's folder, checked: every step trained and logged."""
    summary = _summary(run_dir)
    assert summary["steps"] == MAX_STEPS and summary["stopped_early"] is None, summary
    losses = _losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return Reference(run_dir, losses, load_file(run_dir / "model.safetensors"))


class ReferenceHere:
    """An uninterrupted single-process run in this process (:func:`_run_here`), trained at
    the first :meth:`get`; used as a :class:`ReferenceRun` is."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._result: Reference | None = None

    def get(self) -> Reference:
        if self._result is None:
            result = _run_here(self.run_dir, env=_environment())
            assert result.returncode == 0, f"the reference run failed: {result.stderr[-4000:]}"
            self._result = _reference_in(self.run_dir)
        return self._result


class ReferenceRun:
    """An uninterrupted run started at once in the background; :meth:`get` waits for it."""

    def __init__(self, run_dir: Path, *, nproc: int, overrides: tuple[str, ...] = ()) -> None:
        self.run = Run(run_dir, nproc=nproc, env=_environment(), overrides=overrides)
        self._result: Reference | None = None

    def get(self) -> Reference:
        if self._result is None:
            run = self.run
            assert run.wait() == 0, f"the reference run failed: {run.explain()}"
            self._result = _reference_in(run.run_dir)
        return self._result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> ReferenceHere:
    """One uninterrupted single-process run with the shared overrides, in this process
    when the first test compares with it."""
    return ReferenceHere(tmp_path_factory.mktemp("reference") / "run")


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReferenceRun]:
    """One uninterrupted two-process (DDP over gloo) run with the shared overrides."""
    background = ReferenceRun(tmp_path_factory.mktemp("reference-ddp") / "run", nproc=2)
    try:
        yield background
    finally:
        background.run.kill()


# -- checks --------------------------------------------------------------------------


def assert_preempted_and_committed(run: Run, *, world_size: int) -> tuple[dict, int]:
    """Exit 143, one saved ``preemption`` record, a verified ``step-N``; returns (record, N)."""
    assert run.returncode == EXIT_REQUEUE, run.explain()
    preemptions = _records(run.run_dir, "preemption")
    assert len(preemptions) == 1, preemptions
    record = preemptions[0]
    stopped_at = _latest_train_step(run.run_dir)
    assert ARM_AFTER_STEP <= stopped_at < MAX_STEPS, f"the run should stop mid-way, stopped at {stopped_at}"
    assert record["step"] == stopped_at, record
    assert record["saved"] is True, record
    assert record["checkpoint_step"] == stopped_at, record
    assert record["seconds_left_at_notice"] is not None, record
    assert record["notice_to_commit_s"] < record["seconds_left_at_notice"], record

    summary = _summary(run.run_dir)
    assert summary["steps"] == stopped_at and summary["stopped_early"] == "preemption notice", summary

    store = open_store(str(run.run_dir / "checkpoints"))
    manifest = read_manifest(store, stopped_at)  # raises unless committed
    assert (manifest.step, manifest.world_size) == (stopped_at, world_size)
    rng = {f"rng-rank{rank}.{ext}" for rank in range(world_size) for ext in ("safetensors", "json")}
    expected = {"model.safetensors", "optimizer.safetensors", "optimizer.json", "trainer.json", *rng}
    assert set(manifest.files) == expected
    contents = read_verified(store, stopped_at, manifest)  # sha256 of every listed file
    assert set(contents) == expected
    assert store.read_bytes("LATEST").decode().strip() == f"step-{stopped_at}"
    commits = [r for r in _records(run.run_dir, "checkpoint") if r["step"] == stopped_at]
    assert [r["committed"] for r in commits] == [True], commits
    return record, stopped_at


def assert_resumes_exactly(run_dir: Path, stopped_at: int, background: ReferenceRun | ReferenceHere, *, nproc: int,
                           env: dict, overrides: tuple[str, ...] = ()) -> Run | subprocess.CompletedProcess:
    """Run the same command again: resume from ``stopped_at``, exit 0, equal the reference.
    One process resumes in this process (:func:`_run_here`): nothing stops it, it only reads
    the checkpoint; torchrun's ranks stay a launched job."""
    if nproc == 1:
        rerun = _run_here(run_dir, env=env, overrides=overrides)
        assert rerun.returncode == 0, f"exit code {rerun.returncode}\n{rerun.stderr[-4000:]}"
    else:
        rerun = train_to_end(run_dir, nproc=nproc, env=env, overrides=overrides)
    reference = background.get()
    summary = _summary(run_dir)
    assert summary["resumed_from_step"] == stopped_at, summary
    assert summary["steps"] == MAX_STEPS and summary["stopped_early"] is None, summary
    assert len(_records(run_dir, "preemption")) == 1, "the rerun must not be preempted"

    weights = load_file(run_dir / "model.safetensors")
    assert weights.keys() == reference.weights.keys()
    for name, tensor in reference.weights.items():
        assert torch.equal(weights[name], tensor), f"{name} differs from the uninterrupted run"
    losses = _losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    different = {step: (losses[step], loss) for step, loss in reference.losses.items() if losses[step] != loss}
    assert not different, f"losses (resumed, reference) differ at steps {different}"
    return rerun


# -- the cases -----------------------------------------------------------------------


# One cloud's notice end to end in the fast lane; the other four in the full lane.
@pytest.mark.parametrize("cloud", [pytest.param(cloud, marks=() if cloud == "aws" else pytest.mark.slow)
                                   for cloud in cloud_names()])
def test_spot_notice_saves_in_time_exits_143_and_resumes_exactly(cloud, reference, tmp_path):
    run_dir = tmp_path / "run"
    with MetadataServer() as server, running(run_dir, env=_environment(cloud, server.url)) as run:
        run.wait_for_step(ARM_AFTER_STEP)
        deadline_s = server.arm(cloud, deadline_in_s=NOTICE_LEAD_S)
        run.wait()
        record, stopped_at = assert_preempted_and_committed(run, world_size=1)
        assert f"preemption notice from {cloud}: spot-termination" in run.stderr, run.explain()
        # The client spoke the vendor's protocol: no 400/401/403 on the way.
        assert all(request.status in (200, 404) for request in server.requests), server.requests

    # The deadline the client read is the one the server published (GCP states none:
    # its 30 s window runs from when the client saw the notice).
    save_started_s = record["time"] - record["notice_to_commit_s"]
    read_deadline_s = save_started_s + record["seconds_left_at_notice"]
    assert abs(read_deadline_s - deadline_s) < 10.0, (read_deadline_s, deadline_s, record)
    manifest = read_manifest(open_store(str(run_dir / "checkpoints")), stopped_at)
    assert manifest.created_at < deadline_s

    # Same command, same cloud, nothing announced: the watcher polls and lets it finish.
    with MetadataServer() as quiet:
        assert_resumes_exactly(run_dir, stopped_at, reference, nproc=1, env=_environment(cloud, quiet.url))
        assert len(quiet.requests) > 0, "the rerun never polled the metadata server"
        assert all(request.status in (200, 404) for request in quiet.requests), quiet.requests


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resumes_exactly(reference, tmp_path):
    run_dir = tmp_path / "run"
    with running(run_dir, env=_environment()) as run:
        run.wait_for_step(ARM_AFTER_STEP)
        run.popen.send_signal(signal.SIGTERM)
        run.wait()
        record, stopped_at = assert_preempted_and_committed(run, world_size=1)
    assert record["seconds_left_at_notice"] <= GRACE_S
    assert_resumes_exactly(run_dir, stopped_at, reference, nproc=1, env=_environment())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_stops_both_ranks_together_and_resumes_exactly(reference_ddp, tmp_path):
    run_dir = tmp_path / "run"
    with running(run_dir, nproc=2, env=_environment()) as run:
        run.wait_for_step(ARM_AFTER_STEP)
        run.remember_family()
        workers = [p for p in run.family.values() if _name(p).startswith(WORKER_NAME_PREFIX)]
        assert sorted(map(_name, workers)) == ["skylift-rank0", "skylift-rank1"], \
            [(_name(p), _cmdline(p)) for p in run.family.values()]
        signalled = time.monotonic()
        run.popen.send_signal(signal.SIGTERM)  # the launcher only, as a kubelet or scheduler would
        run.wait(timeout_s=GRACE_S + 30)
        elapsed_s = time.monotonic() - signalled
        record, stopped_at = assert_preempted_and_committed(run, world_size=2)
        assert elapsed_s < GRACE_S, f"the launcher took {elapsed_s:.1f} s, more than the {GRACE_S} s grace"
        assert record["seconds_left_at_notice"] <= GRACE_S, record
        assert not any(worker.is_running() for worker in workers), "a worker outlived the launcher"
        stderr = run.stderr
        assert "terminate called" not in stderr, run.explain()
        # Both ranks acted on the same agreed step.
        assert f"skylift[rank 1]: stopping at step {stopped_at}:" in stderr, run.explain()
    rerun = assert_resumes_exactly(run_dir, stopped_at, reference_ddp, nproc=2, env=_environment())
    assert "terminate called" not in rerun.stderr, rerun.explain()
    assert _summary(run_dir)["replicas_agree"] is True


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []

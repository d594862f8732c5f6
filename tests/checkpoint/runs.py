"""Helpers for tests that train real runs in subprocesses and compare them bitwise.

A single-process run whose start is not under test can run in the test's own process
instead (:func:`train_here`, :func:`lean_train_here`; :func:`run_here` and
:func:`lean_train_in_fixture` for a module- or session-scoped fixture), on one thread inside
:func:`state_kept`: it equals :func:`train`'s subprocess bit for bit, without a Python start
that imports torch (about 4.5 CPU-s)."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy
import torch
from safetensors.torch import load_file

from tests.conftest import REPO_ROOT, run_cli

# fp32 and deterministic kernels: a resumed run must equal the uninterrupted one bit for bit.
EXACT = (
    "precision=fp32",
    "deterministic=true",
    "schedule.max_steps=60",
    "schedule.warmup_steps=10",
    "checkpoint.every_steps=7",
    "checkpoint.every_minutes=null",
    "monitor.log_every_steps=5",
    "monitor.tensorboard=false",
)


LEAN = ("monitor.report=false",)
"""With ``--no-doctor``: what :func:`lean_train` adds. The HTML report's PNGs cost about
1.4 s of a run; the doctor's memory trace costs a launcher of ``--nproc`` workers the
import of torch._dynamo (1.4 s; a training process imports it anyway, for its optimizer).
Neither touches the checkpoints, and their own tests cover them."""

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""A single-process run's threads. On two cores shared with other jobs, two OpenMP threads
wait on each other at every operator: a quickstart step measured 78 ms on one thread and
816 ms on two while other tests ran. Another thread count sums in another order, so every
single-process run that is compared bit for bit goes through :func:`train` and gets this."""


def train(run_dir: Path, *overrides: str, nproc: int = 1, env: dict[str, str] | None = None, timeout_s: float = 300,
          lean: bool = False):
    return run_cli(*train_arguments(run_dir, *overrides, nproc=nproc, lean=lean), env=train_environment(nproc, env),
                   timeout_s=timeout_s)


def train_here(cli_here, run_dir: Path, *overrides: str, env: dict[str, str] | None = None,
               lean: bool = False) -> subprocess.CompletedProcess:
    """:func:`train`'s single-process run in this process: the same arguments through the
    ``cli_here`` fixture inside :func:`state_kept` (one thread, as :data:`ONE_THREAD` gives
    :func:`train`'s subprocess, so the two equal bit for bit). For a run whose start is not
    under test (a reference, a resume whose output is only read, a run that sets up a
    checkpoint): it costs its training only, not a Python start with torch (about 4.5 CPU-s).
    A kill, a signal, an exit code of a process or torchrun's workers need :func:`train`."""
    with state_kept():
        return cli_here(*train_arguments(run_dir, *overrides, lean=lean), env=env)


def lean_train_here(cli_here, run_dir: Path, *overrides: str, env: dict[str, str] | None = None):
    """:func:`train_here` without the doctor's checks and the HTML report (see :data:`LEAN`)."""
    return train_here(cli_here, run_dir, *overrides, env=env, lean=True)


def run_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``skylift ARGS`` in this process, for a module- or session-scoped fixture (which cannot
    use the function-scoped ``cli_here``): from the repository root, ``env`` set for the call,
    stdout and stderr captured, inside :func:`state_kept`; returned as ``cli`` returns it."""
    from skylift.cli.main import main

    stdout, stderr, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    with state_kept(), _redirected(stdout, stderr):
        os.environ.update(env or {})  # state_kept puts the environment back
        os.chdir(REPO_ROOT)
        try:
            code = main(list(args))
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code
        finally:
            os.chdir(cwd)
    return subprocess.CompletedProcess(["skylift", *args], code, stdout.getvalue(), stderr.getvalue())


def lean_train_in_fixture(run_dir: Path, *overrides: str, env: dict[str, str] | None = None):
    """:func:`lean_train`'s single-process run through :func:`run_here`: a reference for a
    module- or session-scoped fixture, equal bit for bit to :func:`lean_train`'s subprocess."""
    return run_here(*train_arguments(run_dir, *overrides, lean=True), env=env)


@contextmanager
def _redirected(stdout: io.StringIO, stderr: io.StringIO) -> Iterator[None]:
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = stdout, stderr
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def train_arguments(run_dir: Path, *overrides: str, nproc: int = 1, lean: bool = False) -> list[str]:
    """The ``skylift`` arguments :func:`train` runs."""
    args = ["run", "examples/quickstart.yaml", "--json", "--set", f"run_dir={run_dir}"]
    if lean:
        args.append("--no-doctor")
    for override in (*EXACT, *(LEAN if lean else ()), *overrides):
        args += ["--set", override]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    return args


def train_environment(nproc: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """:data:`ONE_THREAD` for one process (the launcher shares the cores among ``--nproc``
    workers itself), under the caller's ``env``."""
    return {**(ONE_THREAD if nproc == 1 else {}), **(env or {})}


def lean_train(run_dir: Path, *overrides: str, **kwargs):
    """:func:`train` without the doctor's checks and the HTML report (see :data:`LEAN`)."""
    return train(run_dir, *overrides, lean=True, **kwargs)


class Background:
    """A command started now and collected by :meth:`result`: a reference run that trains on
    one core while the runs compared with it use the other. ``Background.skylift(ARGS)`` is
    ``python -m skylift ARGS`` as :func:`tests.conftest.run_cli` starts it. Killed on leaving
    the ``with`` block if still running (a test that failed early)."""

    def __init__(self, command: list[str], *, env: dict[str, str], timeout_s: float = 300) -> None:
        self.command, self.timeout_s = command, timeout_s
        # Files, not pipes: a full pipe would stall the run while nobody reads it.
        self._stdout, self._stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115 - the run's own
        self.popen = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=self._stdout, stderr=self._stderr,
                                      text=True)

    @classmethod
    def skylift(cls, *args: str, env: dict[str, str] | None = None, timeout_s: float = 300) -> Background:
        return cls([sys.executable, "-m", "skylift", *args], env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                   timeout_s=timeout_s)

    def result(self) -> subprocess.CompletedProcess:
        """Wait for the run to end; what it printed, as :func:`tests.conftest.run_cli` returns it."""
        code = self.popen.wait(timeout=self.timeout_s)
        outputs = []
        for stream in (self._stdout, self._stderr):
            stream.seek(0)
            outputs.append(stream.read())
        return subprocess.CompletedProcess(self.command, code, *outputs)

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.popen.poll() is None:
            import psutil

            # torchrun's workers live in sessions of their own: every descendant, by pid.
            family = psutil.Process(self.popen.pid).children(recursive=True)
            self.popen.kill()
            for process in family:
                with suppress(psutil.Error):
                    process.kill()
            self.popen.wait()
            psutil.wait_procs(family, timeout=30)
        self._stdout.close()
        self._stderr.close()


@contextmanager
def state_kept() -> Iterator[None]:
    """For a ``skylift run`` in this process (``cli_here``), on one thread as :data:`ONE_THREAD`
    gives a subprocess: what the run sets for the whole process put back afterwards. It points
    the ``skylift`` logger at this test's captured stderr and stops it propagating (later
    tests' ``caplog`` would see nothing); ``deterministic`` and the seeds are process-wide; a
    recipe or model named by file path puts its folder on ``sys.path``. The environment (a run
    sets ``CUBLAS_WORKSPACE_CONFIG``) and the SIGTERM and SIGINT handlers come back too."""
    logger = logging.getLogger("skylift")
    environment = dict(os.environ)
    handlers_by_signal = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    handlers, level, propagate, search_path = list(logger.handlers), logger.level, logger.propagate, list(sys.path)
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads, generators = torch.get_num_threads(), (torch.get_rng_state(), random.getstate(), numpy.random.get_state())
    torch.set_num_threads(1)
    try:
        yield
    finally:
        logger.handlers[:], logger.level, logger.propagate, sys.path[:] = handlers, level, propagate, search_path
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.set_num_threads(threads)
        torch.set_rng_state(generators[0])
        random.setstate(generators[1])
        numpy.random.set_state(generators[2])
        if dict(os.environ) != environment:
            os.environ.clear()
            os.environ.update(environment)
        for number, handler in handlers_by_signal.items():
            if handler is not None and signal.getsignal(number) is not handler:
                signal.signal(number, handler)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last loss written for each step (a resumed run rewrites the steps it redoes)."""
    return {record["step"]: record["loss"] for record in records(run_dir, "train")}


def assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"parameter {name} differs from the uninterrupted run"
    assert losses_by_step(run_dir) == losses_by_step(reference)

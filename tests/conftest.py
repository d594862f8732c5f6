"""Shared fixtures: run the real CLI in a subprocess, as a user would.

Nothing a test does may reach past 127.0.0.0/8: the network guard
(``tests/netguard/skylift_netguard.py``) is installed here for this process and, through
``PYTHONPATH``, in every Python process the tests start; a refusal anywhere fails the
test that was running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest_plugins = ["tests.lanes", "tests.xdist_order"]

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "examples"
NETGUARD_DIR = REPO_ROOT / "tests" / "netguard"
NETGUARD_LOG = Path(tempfile.mkdtemp(prefix="skylift-netguard-"))

# Set before any fixture or test starts a process, so every child inherits the guard.
os.environ["SKYLIFT_NETGUARD_LOG"] = str(NETGUARD_LOG)
# torch.compile's kernel cache of this session only: its key leaves out ATEN_CPU_CAPABILITY, so
# kernels a run under another capability left in the shared cache load here and corrupt memory
# (seen as garbage max-pool indices and "free(): invalid pointer").
os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(NETGUARD_LOG.parent / f"{NETGUARD_LOG.name}-inductor")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NETGUARD_DIR), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(NETGUARD_DIR))
import skylift_netguard

# An xdist worker starts with the controller's PYTHONPATH, so sitecustomize installed the guard
# before this file ran, writing to the controller's folder, which no test reads: point it here.
skylift_netguard.install().log_dir = str(NETGUARD_LOG)


def xdist_worker_threads() -> int | None:
    """Under ``pytest -n N``, the CPU threads each worker and every process it starts gets.

    N workers each running torch on all the cores make OpenMP threads spin-wait on each other
    (a quickstart step: 78 ms on one thread, 816 ms on two with other jobs on the cores), so
    the workers share the cores: ``OMP_NUM_THREADS`` (read by every child, the launcher's
    ``setdefault`` included) and this process's own torch. One value for every process of a
    worker keeps a test's two sides of a bitwise comparison on one thread count. A value the
    caller exported wins. ``None`` outside xdist: a serial run is left as it was.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1:
        return None
    return int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // workers))


if (_worker_threads := xdist_worker_threads()) is not None:
    os.environ["OMP_NUM_THREADS"] = str(_worker_threads)
    torch.set_num_threads(_worker_threads)
    # A worker starts with LINES=24 and COLUMNS=80 in its environment (pytest-xdist 3.6.1; one
    # process has neither): every process a test starts would draw for a 24-line terminal, and
    # Rich cuts `skylift monitor`'s frame to that. As in one process, the tests set what they need.
    for _size in ("LINES", "COLUMNS"):
        os.environ.pop(_size, None)


def take_network_refusals() -> list[str]:
    """Every refusal written since the last call, by this process or any child; clears them."""
    refusals = []
    for path in sorted(NETGUARD_LOG.glob("*.log")):
        refusals += path.read_text(encoding="utf-8").splitlines()
        path.unlink()
    return refusals


@pytest.fixture(autouse=True)
def _loopback_only():
    # One that arrived after the previous test ended came from a process it left running.
    if refusals := take_network_refusals():
        _fail_for(refusals, "a process still running from an earlier test reached past loopback:")
    yield
    if refusals := take_network_refusals():
        _fail_for(refusals, "the test reached past loopback:")


TEST_PROCESS_CEILING_BYTES = 6 << 30
"""What a test may leave this pytest process holding. Two xdist workers and the ranks their
tests start share the machine's 24 GiB: a worker past this is on its way to the kernel's OOM
killer, which ends it with no Python frame and every other test's result with it. The
largest any test needs is ~2.7 GiB (the text-classification recipe's in-process runs)."""


@pytest.fixture(autouse=True)
def _memory_ceiling():
    import psutil

    process = psutil.Process()
    before = process.memory_info().rss
    yield
    after = process.memory_info().rss
    if before <= TEST_PROCESS_CEILING_BYTES < after:  # this test crossed it: name this one, not the next
        pytest.fail(f"this test left the test process at {after / 2**30:.1f} GiB (from {before / 2**30:.1f}), over "
                    f"the {TEST_PROCESS_CEILING_BYTES / 2**30:.0f} GiB a test may hold: something it built stayed",
                    pytrace=False)


def _fail_for(refusals: list[str], headline: str) -> None:
    pytest.fail("\n".join([headline, *dict.fromkeys(refusals)]), pytrace=False)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(NETGUARD_LOG, ignore_errors=True)
    shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_cli(*args: str, timeout_s: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m skylift ARGS`` from the repository root; output captured as text."""
    merged = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "skylift", *args],
        cwd=REPO_ROOT,
        env=merged,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture
def cli_here(capsys, monkeypatch):
    """``skylift ARGS`` in this process, returned like ``cli``'s ``CompletedProcess``.

    For checks of what a command says and returns (a config error's exit 2 and message, a
    dry run's plan, what ``shard`` writes): there a process start is not under test, and a
    Python start with torch costs seconds. Tests of a real process boundary (torchrun
    workers, SIGKILL, the environment read at start-up) keep ``cli``'s subprocess.
    ``env`` is set for the call only.
    """
    from skylift.cli.main import main

    monkeypatch.chdir(REPO_ROOT)  # as `cli` runs from the repository root

    def call(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        with monkeypatch.context() as scoped:
            for name, value in (env or {}).items():
                scoped.setenv(name, value)
            capsys.readouterr()
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse's own usage errors
                code = exit_.code
            out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["skylift", *args], code, out, err)

    return call


@pytest.fixture(scope="session")
def moto_server():
    """One moto S3 server on 127.0.0.1 for the session, with sentinel credentials."""
    from tests.servers import S3_ENVIRONMENT, MotoServer

    saved = {name: os.environ.get(name) for name in S3_ENVIRONMENT}
    os.environ.update(S3_ENVIRONMENT)
    server = MotoServer().start()
    yield server
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def s3_bucket(moto_server):
    """A fresh, empty bucket; returns its name."""
    moto_server.reset()
    moto_server.create_bucket("skylift-test")
    return "skylift-test"

"""``skylift run``'s workers, forked from the preloaded server (:mod:`skylift.launch.preloaded_workers`),
take from their launcher what a fresh Python would: two real ranks under torchrun's agent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from skylift.errors import EXIT_REQUEUE
from tests.conftest import REPO_ROOT

PROBE = "tests.train.preloaded_probe"
LAUNCHER = f"""
import os, sys
from skylift.launch.launcher import Topology, launch_workers
from skylift.launch.preloaded_workers import start_server

start_server({PROBE!r})
os.environ["SKYLIFT_TEST_SET_LATE"] = "after the server started"  # as an elastic restart's reason is
sys.exit(launch_workers(Topology(nproc=2, grace_s=5), [{PROBE!r}, *sys.argv[1:]], module=True, preloaded=True))
"""


@pytest.mark.multiprocess
def test_a_forked_worker_gets_the_launchers_environment_stdout_threads_start_method_and_exit_code(tmp_path):
    launched = subprocess.run([sys.executable, "-c", LAUNCHER, str(tmp_path), str(EXIT_REQUEUE)], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              check=False)  # fmt: skip
    assert launched.returncode == EXIT_REQUEUE, launched.stderr[-3000:]  # a worker's 143 is the launcher's
    fresh_python = subprocess.run([sys.executable, "-c", "import multiprocessing as m; print(m.get_start_method())"],
                                  capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts["set_after_the_server_started"] == "after the server started"
        assert facts["start_method"] == fresh_python
        assert facts["batches"] == [[10 * rank, 10 * rank + 1], [10 * rank + 2, 10 * rank + 3]]
        assert facts["threads"] == 1
        assert facts["argv"] == [str(tmp_path), str(EXIT_REQUEUE)]
        if sys.platform == "linux":
            assert facts["name"] == f"skylift-rank{rank}"
        assert f"probe rank {rank} says hello" in launched.stdout
    # As for a worker started as a program: torch's one line for the exit, not its poll's traceback.
    assert "failed (exitcode: 143)" in launched.stderr and "Traceback" not in launched.stderr, launched.stderr

"""The lane plugin (tests/lanes.py) and the parallel lane: the assertions counted under
``pytest -n 2`` are those counted in one process, and each xdist worker gets its share of
the cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, xdist_worker_threads

# One assertion in the fixture's setup and one in its teardown, one plus four in the loop of
# test_one: 7 for test_one; one for each of test_two's two cases: 9 in 3 tests.
INNER_SUITE = '''
import pytest


@pytest.fixture
def ready():
    assert True
    yield 3
    assert 1 == 1


def test_one(ready):
    assert ready == 3
    for i in range(4):
        assert i < 4


@pytest.mark.parametrize("n", [1, 2])
def test_two(n):
    assert n
'''
INNER_ASSERTIONS, INNER_TESTS = 7 + 1 + 1, 3


def _with_the_repository() -> dict[str, str]:
    """This environment with the repository on PYTHONPATH: the inner pytest loads ``tests.lanes``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def _inner_pytest(folder, *args: str, suite: str = INNER_SUITE, passes: bool = True) -> str:
    folder.mkdir()
    (folder / "test_inner.py").write_text(suite)
    command = [sys.executable, "-m", "pytest", "-p", "tests.lanes", "-o", "enable_assertion_pass_hook=true", "-q",
               "-p", "no:cacheprovider", *args]
    result = subprocess.run(command, cwd=folder, env=_with_the_repository(), capture_output=True, text=True,
                            timeout=120, check=False)
    assert (result.returncode == 0) == passes, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def _counted(output: str) -> tuple[int, int]:
    found = re.search(r"lanes: (\d+) assertions passed in (\d+) tests", output)
    assert found, output
    return int(found[1]), int(found[2])


def test_the_assertions_counted_on_two_workers_are_those_counted_in_one_process(tmp_path):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    assert _counted(_inner_pytest(serial)) == (INNER_ASSERTIONS, INNER_TESTS)
    output = _inner_pytest(parallel, "-n", "2", "--dist", "loadfile", "-v")  # -q -v: xdist names its workers
    assert "2 workers [3 items]" in output, output
    assert _counted(output) == (INNER_ASSERTIONS, INNER_TESTS)


@pytest.mark.parametrize(("cores", "workers", "threads"), [(2, 2, 1), (16, 2, 8), (3, 2, 1), (1, 4, 1)])
def test_each_worker_gets_its_share_of_the_cores(monkeypatch, cores, workers, threads):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    assert xdist_worker_threads() == threads


def test_a_thread_count_exported_by_the_caller_wins_and_one_process_is_left_as_it_was(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert xdist_worker_threads() == 3
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert xdist_worker_threads() is None


# One test of 1 s against a limit of 0.7 s: over it in one process; under the 1.4 s that two
# workers sharing the cores get, with 0.4 s for the test's setup, teardown and a late wake-up.
ONE_SECOND_SUITE = """
import time


def test_one_second():
    time.sleep(1.0)
"""


def test_the_fast_lane_limit_is_as_many_times_longer_as_there_are_workers(tmp_path):
    limit = ("--lane-fail-s=0.7", "--lane-report-s=0.7")
    serial = _inner_pytest(tmp_path / "serial", *limit, suite=ONE_SECOND_SUITE, passes=False)
    over = r"test_one_second took 1\.\d s, over the fast lane's 0.7 s: mark it @pytest.mark.slow"
    assert re.search(over, serial), serial
    parallel = _inner_pytest(tmp_path / "parallel", *limit, "-n", "2", "--dist", "loadfile", suite=ONE_SECOND_SUITE)
    assert "too slow for the fast lane" not in parallel and "1 passed" in parallel, parallel


FILE_OF_THREE_FAST_TESTS = """
def test_a1():
    pass


def test_a2():
    pass


def test_a3():
    pass
"""
FILE_OF_ONE_SLOW_TEST = """
import pytest


@pytest.mark.slow
def test_b1():
    pass
"""


def test_the_file_expected_to_take_longest_is_dealt_first(tmp_path):
    """xdist alone deals the file with the most tests first: test_a.py. One slow test is
    expected to take longer than three fast ones (tests/xdist_order.py), so test_b.py goes first."""
    (tmp_path / "test_a.py").write_text(FILE_OF_THREE_FAST_TESTS)
    (tmp_path / "test_b.py").write_text(FILE_OF_ONE_SLOW_TEST)
    command = [sys.executable, "-m", "pytest", "-p", "tests.xdist_order", "-o", "markers=slow: slow",
               "-p", "no:cacheprovider", "-n", "1", "--dist", "loadfile", "-v"]
    result = subprocess.run(command, cwd=tmp_path, env=_with_the_repository(), capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ran = re.findall(r"PASSED (test_\w+\.py::test_\w+)", result.stdout)
    assert ran == ["test_b.py::test_b1", *(f"test_a.py::test_a{n}" for n in (1, 2, 3))], result.stdout


def test_no_assertion_inside_a_polling_loop_is_counted():
    """The assertion count compares a cheaper suite with the one before it, so it must not
    grow with the machine's slowness: an ``assert`` inside a ``while`` loop (a loop that polls
    a process or a file) passes once per poll. Such loops raise ``AssertionError`` themselves."""
    import ast

    counted_per_poll = []
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        for loop in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(loop, ast.While):
                counted_per_poll += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
                                     for node in ast.walk(loop) if isinstance(node, ast.Assert)]
    assert not counted_per_poll, f"replace with `if not ...: raise AssertionError(...)`: {counted_per_poll}"

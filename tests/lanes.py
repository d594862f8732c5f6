"""Keeps the two test lanes honest: a fast-lane test is one that is fast when measured.

``make test`` runs the fast lane (everything not marked ``slow``); ``make test-all`` runs
everything. A test belongs in the fast lane while its setup, call and teardown together stay
under ``--lane-report-s`` (10 s on two cores). This plugin lists every unmarked test above that
and, with ``--lane-fail-s`` (30 s in the Makefile), fails the run when one passes it, naming
the test and the marker to add. It reads wall time to say where a test belongs, never whether
the code under test is fast: behaviour is asserted by the tests themselves. With ``-n N``
(pytest-xdist) N workers share the cores, so a test gets 1/N of the machine the limits were set
on and both limits are N times as long; the controller judges, from every worker's reports.

It also counts the assertions that passed (pytest's assertion-pass hook sees every plain
``assert`` in the test modules pytest rewrites), so a change that makes the suite cheaper can
show that it still checks as much as before. Under pytest-xdist (``-n N``) the assertions pass
in the workers: each test report carries its phase's count (``skylift_assertions``, sent with the
report as pytest's own fields are) and the controller adds them up from the reports it receives,
as it does the durations.
"""

from __future__ import annotations

import collections

import pytest

ASSERTIONS_FIELD = "skylift_assertions"
"""The test report's field with the assertions that passed in its phase (setup, call, teardown)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("skylift lanes")
    group.addoption(
        "--lane-report-s",
        type=float,
        default=10.0,
        help="list every test not marked slow whose setup + call + teardown took longer (seconds)",
    )
    group.addoption(
        "--lane-fail-s",
        type=float,
        default=0.0,
        help="fail the run when a test not marked slow took longer than this (seconds); 0: never",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(LaneTimer(config), "skylift-lane-timer")


def sharing_workers(config: pytest.Config) -> int:
    """How many pytest-xdist workers share the cores (1 in one process)."""
    if config.getoption("dist", "no") == "no":
        return 1
    return max(1, int(config.getoption("numprocesses", 1) or 1))


class LaneTimer:
    def __init__(self, config: pytest.Config) -> None:
        # With N workers on the cores a test gets 1/N of the machine the lane's limits were set
        # on (one process on 2 cores), so each limit is N times as long. A worker never judges:
        # the controller sees every worker's reports.
        self.workers = sharing_workers(config)
        self.report_s: float = config.getoption("--lane-report-s") * self.workers
        self.fail_s: float = 0.0 if hasattr(config, "workerinput") else config.getoption("--lane-fail-s") * self.workers
        self.seconds_by_test: dict[str, float] = collections.defaultdict(float)
        self.assertions_by_test: collections.Counter[str] = collections.Counter()
        self.assertions_in_phase: collections.Counter[str] = collections.Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Setup counts too: a fixture that trains a run is paid by the first test that asks for it.
        if "slow" not in report.keywords:
            self.seconds_by_test[report.nodeid] += report.duration
        if passed := getattr(report, ASSERTIONS_FIELD, 0):
            self.assertions_by_test[report.nodeid] += passed

    def pytest_assertion_pass(self, item: pytest.Item) -> None:
        self.assertions_in_phase[item.nodeid] += 1

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
        report = yield
        setattr(report, ASSERTIONS_FIELD, self.assertions_in_phase.pop(item.nodeid, 0))
        return report

    def over(self, limit_s: float) -> list[tuple[float, str]]:
        return sorted(((s, test) for test, s in self.seconds_by_test.items() if s > limit_s), reverse=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.fail_s and exitstatus == pytest.ExitCode.OK and self.over(self.fail_s):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        write = terminalreporter.write_line
        total = sum(self.assertions_by_test.values())
        write(f"lanes: {total} assertions passed in {len(self.assertions_by_test)} tests")
        shared = f", {self.workers} workers sharing the cores" if self.workers > 1 else ""
        if long_ones := self.over(self.report_s):
            heading = f"tests not marked slow over {self.report_s:g} s (setup + call + teardown{shared})"
            terminalreporter.section(heading)
            for seconds, test in long_ones:
                write(f"{seconds:6.1f} s  {test}")
        if self.fail_s and (too_long := self.over(self.fail_s)):
            terminalreporter.section("too slow for the fast lane", red=True)
            for seconds, test in too_long:
                write(
                    f"{test} took {seconds:.1f} s, over the fast lane's {self.fail_s:g} s{shared}: mark it "
                    "@pytest.mark.slow (make test-all runs it) or make it cheaper",
                    red=True,
                )

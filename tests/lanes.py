"""Keeps the two test lanes honest: a fast-lane test is one that is fast when measured.

``make test`` runs the fast lane (everything not marked ``slow``); ``make test-all`` runs
everything. A test belongs in the fast lane while its setup, call and teardown together stay
under ``--lane-report-s`` (10 s on two cores). This plugin lists every unmarked test above that
and, with ``--lane-fail-s`` (30 s in the Makefile), fails the run when one passes it, naming
the test and the marker to add. It reads wall time to say where a test belongs, never whether
the code under test is fast: behaviour is asserted by the tests themselves.

It also counts the assertions that passed (pytest's assertion-pass hook sees every plain
``assert`` in the test modules pytest rewrites), so a change that makes the suite cheaper can
show that it still checks as much as before.
"""

from __future__ import annotations

import collections

import pytest


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


class LaneTimer:
    def __init__(self, config: pytest.Config) -> None:
        self.report_s: float = config.getoption("--lane-report-s")
        self.fail_s: float = config.getoption("--lane-fail-s")
        self.seconds_by_test: dict[str, float] = collections.defaultdict(float)
        self.assertions_by_test: collections.Counter[str] = collections.Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Setup counts too: a fixture that trains a run is paid by the first test that asks for it.
        if "slow" not in report.keywords:
            self.seconds_by_test[report.nodeid] += report.duration

    def pytest_assertion_pass(self, item: pytest.Item) -> None:
        self.assertions_by_test[item.nodeid] += 1

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
        if long_ones := self.over(self.report_s):
            terminalreporter.section(f"tests not marked slow over {self.report_s:g} s (setup + call + teardown)")
            for seconds, test in long_ones:
                write(f"{seconds:6.1f} s  {test}")
        if self.fail_s and (too_long := self.over(self.fail_s)):
            terminalreporter.section("too slow for the fast lane", red=True)
            for seconds, test in too_long:
                write(
                    f"{test} took {seconds:.1f} s, over the fast lane's {self.fail_s:g} s: mark it "
                    "@pytest.mark.slow (make test-all runs it) or make it cheaper",
                    red=True,
                )

"""Under ``pytest -n N --dist loadfile``: the test files expected to take longest go first.

xdist deals whole files to its workers, the files with the most tests first. A file of two
30 s end-to-end runs then comes near the end, and one worker runs it while the others have
nothing left. Dealing the longest first (the longest-processing-time rule) keeps the
workers finishing together. A file's expected time counts each test by its lane: the
controller sees only test names, so each worker writes which of the tests it collected are
marked ``slow`` to a folder the controller named in its ``workerinput``, before it reports
its collection; the controller reads them when it deals the first file. Without xdist this
does nothing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

SLOW_TEST_S = 15.0
"""A slow-lane test's expected seconds: the lanes measured on 2 cores (docs/development.md),
75 slow tests in 1,418 - 288 = 1,130 s of the full lane."""
FAST_TEST_S = 0.3
"""A fast-lane test's: 888 tests in 288 s."""
_FOLDER_KEY = "skylift_lanes_folder"
_created: list[str] = []
"""The folder this controller made, for its workers to write in (sent in their ``workerinput``)."""


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and config.getoption("dist", "no") == "loadfile":
        _created.append(tempfile.mkdtemp(prefix="skylift-xdist-lanes-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    while _created:
        shutil.rmtree(_created.pop(), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    if _created:
        node.workerinput[_FOLDER_KEY] = _created[-1]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    folder = getattr(config, "workerinput", {}).get(_FOLDER_KEY)
    if folder is None:
        return
    slow = {item.nodeid: "slow" in item.keywords for item in items}
    target = Path(folder) / f"{config.workerinput['workerid']}.json"
    partial = target.with_suffix(".partial")
    partial.write_text(json.dumps(slow), encoding="utf-8")
    partial.replace(target)  # whole or absent: the controller never reads half a file


def expected_seconds(nodeids, slow: dict[str, bool]) -> float:
    return sum(SLOW_TEST_S if slow.get(nodeid) else FAST_TEST_S for nodeid in nodeids)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") != "loadfile" or not _created:
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFileFirst(LoadFileScheduling):
        _ordered = False

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:
                slow = _slow_marks(Path(_created[-1]))
                by_time = sorted(self.workqueue.items(), key=lambda unit: -expected_seconds(unit[1], slow))
                self.workqueue.clear()
                self.workqueue.update(by_time)
                self._ordered = True
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


def _slow_marks(folder: Path) -> dict[str, bool]:
    slow: dict[str, bool] = {}
    for path in sorted(folder.glob("*.json")):
        slow.update(json.loads(path.read_text(encoding="utf-8")))
    return slow

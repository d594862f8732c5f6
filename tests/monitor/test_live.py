"""``skylift monitor``: one frame of a real run, the tailer on torn and growing files, the live loop."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from rich.console import Console

from skylift.cli.main import main
from skylift.monitor.live import LiveState, MetricsTail, follow, render
from tests.conftest import REPO_ROOT
from tests.monitor.conftest import MAX_STEPS
from tests.monitor.synthetic import PREEMPTED_AT, TOTAL_STEPS, synthetic_records


def _line(record: dict) -> bytes:
    return (json.dumps(record) + "\n").encode()


def _frame(state: LiveState, run_dir: Path) -> str:
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render(state, run_dir))
    return console.export_text()


@pytest.mark.slow
def test_monitor_once_on_a_real_run_shows_the_figures(preempted_run, monkeypatch, capsys):
    # In-process: no process boundary is under test here, and a Python start with the CLI's imports
    # costs seconds (the live loop below is the one that runs ``skylift monitor`` as a process).
    monkeypatch.setenv("COLUMNS", "120")
    capsys.readouterr()
    code = main(["monitor", str(preempted_run), "--once"])
    frame, errors = capsys.readouterr()
    assert code == 0, errors
    for expected in ("attempt 2", "loss", "samples/s", "MFU", "data wait", "step time", "system",
                     "last checkpoint", f"step {MAX_STEPS}", "preemption notice"):
        assert expected in frame, f"{expected!r} missing from:\n{frame}"
    records = [json.loads(line) for line in (preempted_run / "metrics.jsonl").read_text().splitlines()]
    if any(r["kind"] == "run_start" for r in records):  # written by this version: total steps are known
        assert f"{MAX_STEPS} / {MAX_STEPS}" in frame, frame


def test_tail_survives_a_torn_line_a_growing_file_and_a_replaced_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first, second, third = ({"kind": "train", "step": s, "time": float(s)} for s in (1, 2, 3))
    tail = MetricsTail(path)
    assert tail.read() == ([], False), "a missing file is not an error: the run may not have started"
    torn = _line(second)
    path.write_bytes(_line(first) + torn[:9])
    assert tail.read() == ([first], False)
    with path.open("ab") as file:
        file.write(torn[9:] + _line(third))
    assert tail.read() == ([second, third], False)
    assert tail.read() == ([], False)

    replacement = tmp_path / "new.jsonl"
    replacement.write_bytes(_line(first))
    os.replace(replacement, path)  # a new file (another inode), as a copy from another node would be
    assert tail.read() == ([first], True)


def test_a_torn_fragment_does_not_swallow_the_next_attempts_first_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    start = {"kind": "run_start", "time": 5.0, "attempt": 2, "step": 2}
    # A writer killed mid-line; the resumed run appends its first record straight after.
    path.write_bytes(_line({"kind": "train", "step": 1})[:12] + _line(start))
    assert MetricsTail(path).read() == ([start], False)


def test_state_follows_attempts_and_renders_gpus_cost_and_diagnosis(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = synthetic_records()
    cut = next(i for i, r in enumerate(records) if r["kind"] == "preemption") + 1
    path.write_bytes(b"".join(_line(r) for r in records[:cut]))
    tail = MetricsTail(path)
    state = follow(tail, LiveState())
    assert state.attempt == 1
    frame = _frame(state, tmp_path)
    assert "preempted (waiting for a resume)" in frame and f"at step {PREEMPTED_AT}" in frame

    with path.open("ab") as file:
        file.write(b"".join(_line(r) for r in records[cut:]))
    state = follow(tail, state)
    assert state.attempt == 2
    assert all(r["step"] > PREEMPTED_AT for r in state.train), "rates must not mix attempts"
    frame = _frame(state, tmp_path)
    for expected in (f"{TOTAL_STEPS} / {TOTAL_STEPS}", "finished", "GPU 0", "GPU 1", "mem 41.0 / 79.6 GiB",
                     "MFU", "forward_backward", "spent", "saved vs on-demand", "bound: compute"):
        assert expected in frame, f"{expected!r} missing from:\n{frame}"


def test_monitor_defaults_to_the_newest_run_folder(tmp_path, monkeypatch, capsys):
    for name, mtime in (("old", 1_000.0), ("new", 2_000.0)):
        path = tmp_path / "runs" / name / "metrics.jsonl"
        path.parent.mkdir(parents=True)
        path.write_bytes(_line({"kind": "train", "step": 3, "epoch": 0, "loss": 0.5, "time": mtime}))
        os.utime(path, (mtime, mtime))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "120")
    assert main(["monitor", "--once"]) == 0
    assert f"{Path('runs') / 'new'} · attempt 1" in capsys.readouterr().out


def test_monitor_without_a_run_folder_says_what_to_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["monitor", "--once"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "Next: skylift run examples/quickstart.yaml"
    assert main(["monitor", str(tmp_path / "typo"), "--once"]) == 2
    assert "typo" in capsys.readouterr().err


def test_live_loop_picks_up_records_appended_while_it_runs(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_bytes(_line({"kind": "train", "step": 1, "epoch": 0, "loss": 2.0, "time": time.time()}))
    # Rich draws live frames only on a terminal; these make the pipe count as one.
    env = {**os.environ, "COLUMNS": "120", "TTY_COMPATIBLE": "1", "FORCE_COLOR": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NO_COLOR", None)
    monitor = subprocess.Popen([sys.executable, "-m", "skylift", "monitor", str(run_dir), "--interval-s", "0.1"],
                               cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    screen = _Screen(monitor.stdout)
    try:
        screen.wait_for("2.0000", timeout_s=60)  # the first frame
        with metrics.open("ab") as file:
            file.write(_line({"kind": "train", "step": 7, "epoch": 0, "loss": 0.25, "time": time.time()}))
            file.write(_line({"kind": "checkpoint", "step": 7, "committed": True, "stall_s": 0.01, "write_s": 0.1,
                              "time": time.time()}))
        screen.wait_for("0.2500", timeout_s=20)
        screen.wait_for("step 7,", timeout_s=5)
        monitor.send_signal(signal.SIGINT)  # Ctrl-C ends the view: exit 0
        assert monitor.wait(timeout=20) == 0, monitor.stderr.read().decode()
    finally:
        if monitor.poll() is None:
            monitor.kill()
            monitor.wait()


class _Screen:
    """Everything a process writes to a pipe, ANSI codes removed, read on a thread."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.text = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe: IO[bytes]) -> None:
        for chunk in iter(lambda: pipe.read1(65536), b""):
            with self._lock:
                self.text += re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", chunk.decode(errors="replace"))

    def wait_for(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if needle in self.text:
                    return
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} never appeared on the screen:\n{self.text[-3000:]}")

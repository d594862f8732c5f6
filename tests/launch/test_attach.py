"""Zero-line attach: an unchanged Trainer or Lightning script under ``skylift launch`` gets
skylift's callback (once, even if the program adds it too) and resumes from the newest
complete checkpoint; ``--no-attach`` leaves it alone; a program that imports neither
library pays nothing measurable for the hook.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "programs"
ATTACHED = "skylift: attached SkyliftCallback to"


def _launch(cwd: Path, *command: str, flags: tuple[str, ...] = ()) -> str:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
    env["PYTHONUNBUFFERED"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "skylift", "launch", "--nproc", "1", "--no-doctor", *flags, "--", "python", *command],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def _the_line(output: str, start: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(start)]
    assert len(lines) == 1, output[-4000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_unchanged_trainer_script_is_attached_once_and_resumes(tmp_path):
    script = str(PROGRAMS / "trainer_job.py")
    first = _launch(tmp_path, script, "out", "6")
    assert "no complete checkpoint: fresh start" in _the_line(first, ATTACHED)
    assert _the_line(first, "callbacks=") == "callbacks=1 step=6"
    assert (tmp_path / "out" / "checkpoint-6" / "manifest.json").is_file()  # sealed by skylift
    assert any(json.loads(line).get("kind") == "train" for line in (tmp_path / "out" / "metrics.jsonl").open())

    # A program that adds the callback itself gets it once; train() resumes at the newest complete checkpoint.
    second = _launch(tmp_path, script, "out", "9", "own")
    said = _the_line(second, "skylift: Trainer already has a SkyliftCallback")
    assert said.endswith("resuming from out/checkpoint-6 (skylift launch --no-attach or SKYLIFT_ATTACH=0 turns this off)")
    assert _the_line(second, "callbacks=") == "callbacks=1 step=9"
    state = json.loads((tmp_path / "out" / "checkpoint-9" / "trainer_state.json").read_text())
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry][:1] == [1]  # the first run's log

    # --no-attach: the Trainer as the program wrote it.
    third = _launch(tmp_path, script, "plain", "3", flags=("--no-attach",))
    assert "SkyliftCallback" not in third
    assert _the_line(third, "callbacks=") == "callbacks=0 step=3"
    assert not (tmp_path / "plain" / "checkpoint-3" / "manifest.json").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_unchanged_lightning_script_is_attached_and_resumes(tmp_path):
    script = str(PROGRAMS / "lightning_plain_job.py")
    first = _launch(tmp_path, script, "4")
    assert "Lightning Trainer; no complete checkpoint: fresh start" in _the_line(first, ATTACHED)
    assert _the_line(first, "callbacks=") == "callbacks=1 step=4"
    second = _launch(tmp_path, script, "8")
    assert "resuming from " in _the_line(second, ATTACHED) and "step-4" in _the_line(second, ATTACHED)
    assert _the_line(second, "callbacks=") == "callbacks=1 step=8"


MEASURE = """
import sys, time, timeit
import skylift.loop.distributed  # what the shim has imported (torch) before it installs the hook
before = set(sys.modules)
started = time.perf_counter()
from skylift.integrations.attach import install
install()
install_s = time.perf_counter() - started
finder = sys.meta_path[0]
miss_s = timeit.timeit(lambda: finder.find_spec("numpy.linalg", None), number=20000) / 20000
print(install_s, miss_s, sorted(set(sys.modules) - before))
"""


def test_the_hook_costs_a_program_that_imports_neither_library_nothing_measurable():
    """In a worker the shim has imported torch already; the hook adds one small module
    (about 1 ms with its bytecode cached, measured with -X importtime) and half a
    microsecond per later import (the finder's dict lookup)."""
    output = subprocess.run([sys.executable, "-c", MEASURE], check=True, capture_output=True, text=True).stdout
    install_s, miss_s, added = output.split(" ", 2)
    assert added.strip() == "['skylift.integrations', 'skylift.integrations.attach']"
    assert float(install_s) < 0.1, output  # compiling it too (no bytecode cache in the tests): still small
    assert float(miss_s) < 20e-6, output

"""The attach reaches the workers' Python children, and a nested ``accelerate launch``
runs in the worker.

``skylift launch`` puts ``skylift/integrations/startup`` first on the workers'
``PYTHONPATH``; its ``sitecustomize.py`` installs the hook at the first import of
``transformers``, ``lightning`` or ``accelerate`` in any Python process below a worker,
then runs the ``sitecustomize`` it shadows (here the test suite's own network guard).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from skylift.integrations.attach import STARTUP_FOLDER, with_startup_path
from tests.conftest import REPO_ROOT

PROGRAMS = Path(__file__).parent / "programs"


def _hooked_environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
    env.update(PYTHONPATH=with_startup_path(os.environ.get("PYTHONPATH")), PYTHONUNBUFFERED="1", **extra)
    return env


CHILD = """
import sys
started_with = sorted(name for name in sys.modules if name.startswith("skylift"))
guard = sys.modules["sitecustomize"].__file__
import accelerate.commands.launch as launch
print(started_with, guard, launch.simple_launcher._skylift_in_process, "skylift.integrations.attach" in sys.modules)
"""


def test_a_child_python_gets_the_hook_at_its_first_accelerate_import_and_keeps_the_shadowed_sitecustomize():
    assert with_startup_path(f"a{os.pathsep}{STARTUP_FOLDER}") == f"{STARTUP_FOLDER}{os.pathsep}a"
    output = subprocess.run([sys.executable, "-c", CHILD], env=_hooked_environment(), check=True,
                            capture_output=True, text=True, timeout=120).stdout
    started_with, guard, patched, attached = output.split()
    # Before its first import of a trigger package the child has loaded nothing of skylift but the guard's own.
    assert started_with == "['skylift_netguard']", output
    assert guard == str(REPO_ROOT / "tests" / "netguard" / "sitecustomize.py")  # the shadowed one ran
    assert (patched, attached) == ("True", "True")


COST = """
import sys, timeit
trigger = sys.meta_path[0]
assert type(trigger).__name__ == "SkyliftAttachTrigger", sys.meta_path
print(timeit.timeit(lambda: trigger.find_spec("numpy.linalg"), number=50000) / 50000)
"""


def test_the_startup_hook_costs_a_program_that_imports_none_of_the_libraries_nothing_measurable(tmp_path):
    """Measured on the CI machine: the sitecustomize about 0.3 ms to import with its
    bytecode cached (2.3 ms compiling it, with PYTHONDONTWRITEBYTECODE), against ~20 ms
    for the interpreter's start; 0.1 µs per later import."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env.update(PYTHONPATH=STARTUP_FOLDER, PYTHONPYCACHEPREFIX=str(tmp_path))  # bytecode cached, outside the tree
    import_s = []
    for _ in range(5):
        lines = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], env=env, check=True,
                               capture_output=True, text=True).stderr.splitlines()
        [line] = [line for line in lines if line.split("|")[-1].strip() == "sitecustomize"]
        import_s.append(int(line.split("|")[1]) / 1e6)
    assert min(import_s) < 0.005, import_s
    miss_s = float(subprocess.run([sys.executable, "-c", COST], env=env, check=True, capture_output=True,
                                  text=True).stdout)
    assert miss_s < 5e-6, miss_s


@pytest.mark.slow
@pytest.mark.multiprocess
def test_accelerate_launch_inside_a_worker_runs_the_script_in_that_worker(tmp_path):
    """``skylift launch --nproc 2 -- accelerate launch job.py``: job.py runs in the two
    workers torchrun started (children of the launcher), not in a second generation of
    processes that would form another group on the same rendezvous."""
    process = subprocess.run(
        [sys.executable, "-m", "skylift", "launch", "--nproc", "2", "--no-doctor", "--no-attach", "--",
         "accelerate", "launch", str(PROGRAMS / "accelerate_job.py"), str(tmp_path)],
        cwd=tmp_path, env=_hooked_environment(), capture_output=True, text=True, timeout=300, check=False,
    )
    output = process.stdout + process.stderr
    assert process.returncode == 0, output[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(rank["world_size"], rank["sum_of_ranks"]) for rank in ranks] == [(2, 3.0), (2, 3.0)]
    # Both ran in torchrun's workers: their parent is the launcher (torchrun's agent runs in it).
    assert len({rank["parent_pid"] for rank in ranks}) == 1 and len({rank["pid"] for rank in ranks}) == 2, ranks
    [said] = [line for line in output.splitlines() if line.startswith("skylift: accelerate launch inside")]
    assert "accelerate_job.py runs in each of the 2 worker(s) skylift started" in said

"""Worker start: ``skylift run --nproc N`` against torchrun starting the same worker.

Both run the quickstart for a few steps on N local workers over gloo, with the same
worker code (``skylift.cli.worker``) and the same torchrun agent underneath:

* ``torchrun``: ``python -m torch.distributed.run --nproc-per-node N -m skylift.cli.worker
  CONFIG``, every worker a Python start that imports torch and the trainer;
* ``skylift``: ``skylift run CONFIG --nproc N``, workers forked from one server that has
  imported them (:mod:`skylift.launch.preloaded_workers`).

Measured per run: ``first_step_s``, from the command's start to the first ``train`` record
of rank 0 (``monitor.log_every_steps=1``), and ``cpu_s``, the CPU time of the whole process
tree (this process is the tree's subreaper, so even the fork server, which outlives its
launcher by a moment, is counted). The contenders alternate, each round in rotated order;
reported: medians and skylift's ratio to torchrun's. Linux only (the subreaper).

    python -m benchmarks.worker_start [--quick] [--nproc 2]   # writes benchmarks/results/worker_start.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import environment

RESULTS = Path(__file__).parent / "results" / "worker_start.json"
CONFIG = "examples/quickstart.yaml"
STEPS = 5
SETTINGS = (f"schedule.max_steps={STEPS}", "schedule.warmup_steps=0", "monitor.log_every_steps=1",
            "monitor.report=false", "monitor.tensorboard=false", "checkpoint.enabled=false",
            "preemption.cloud=off")  # fmt: skip


def _command(contender: str, nproc: int, run_dir: Path) -> list[str]:
    overrides = [item for setting in (*SETTINGS, f"run_dir={run_dir}") for item in ("--set", setting)]
    if contender == "torchrun":
        with socket.socket() as probe:  # torchrun's own static rendezvous needs a port
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "skylift.cli.worker", CONFIG, *overrides]
    return [sys.executable, "-m", "skylift", "run", CONFIG, "--nproc", str(nproc), "--no-doctor", *overrides]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _reap_all() -> None:
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def measure(contender: str, nproc: int) -> dict[str, float]:
    """One run: seconds to rank 0's first step and the CPU seconds of every process it started."""
    with tempfile.TemporaryDirectory(prefix="skylift-bench-start-") as folder:
        run_dir = Path(folder) / "run"
        environment_ = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
        cpu_before, started = _children_cpu_s(), time.time()
        completed = subprocess.run(_command(contender, nproc, run_dir), env=environment_, capture_output=True,
                                   text=True, check=False)  # fmt: skip
        _reap_all()
        if completed.returncode != 0:
            raise RuntimeError(f"{contender} exited {completed.returncode}:\n{completed.stderr[-3000:]}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        first = min(record["time"] for record in records if record["kind"] == "train")
        return {"first_step_s": round(first - started, 3), "cpu_s": round(_children_cpu_s() - cpu_before, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans are reaped (and counted) here
    contenders, rounds = ["torchrun", "skylift"], 2 if args.quick else 5
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    load = os.getloadavg()
    for index in range(rounds):
        for name in contenders[index % 2:] + contenders[:index % 2]:
            runs[name].append(measure(name, args.nproc))
            print(name, runs[name][-1], flush=True)
    figures = ("first_step_s", "cpu_s")
    medians = {name: {key: round(statistics.median(run[key] for run in runs[name]), 3) for key in figures}
               for name in contenders}  # fmt: skip
    result: dict[str, Any] = {
        "config": {"nproc": args.nproc, "rounds": rounds, "steps": STEPS, "settings": list(SETTINGS),
                   "load_average_at_start": load,
                   **environment(max(1, (os.cpu_count() or 1) // args.nproc), ("torch",))},
        "results": {"runs": runs, "median": medians,
                    "skylift_over_torchrun": {key: round(medians["skylift"][key] / medians["torchrun"][key], 3)
                                              for key in figures}},
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["results"]["median"]), json.dumps(result["results"]["skylift_over_torchrun"]))


if __name__ == "__main__":
    main()

"""Lose a node, keep training: seconds from the loss to the survivors' next step.

Two real ``skylift run --nnodes 1:2`` agents on loopback (one worker each, gloo, torchrun's
c10d rendezvous, the loopback AWS metadata server of ``tests/cloud``) train the quickstart's
CNN at a few widths (its checkpoint grows with the square of the width). After step
``trigger_step`` node 1 is lost, two ways:

* ``notice``: an AWS spot notice on node 1's metadata endpoint. Both nodes checkpoint at
  the next step boundary; node 1 leaves (exit 143), node 0 re-forms alone and continues;
* ``sigkill``: node 1's agent and worker are SIGKILLed; node 0's worker sees gloo's closed
  socket, its agent restarts it from the newest complete checkpoint.

Measured, per width and way: ``loss_to_next_step_s``, from the notice's publication (or
the kill) to the end of the survivor's first step at world size 1 (the first ``train``
record after it, ``monitor.log_every_steps=1``), and the ``membership`` record's own
``seconds_lost`` and ``steps_lost``. Against it, the stop-everything-and-relaunch path of
a fixed-size job: the same save, then every node waits ``relaunch_s`` for the platform to
bring the whole job back, then worker start and resume (taken as this run's own
``loss_to_next_step_s``, which holds both). ``relaunch_s`` is a parameter, recorded in the
config and never in the results, which hold only what was measured: neither
SageMaker nor SkyPilot documents a relaunch time; the default is skylift's planner's own
assumption (``skylift.plan.ranking.DEFAULT_RESTART_S``, 600 s: new capacity, image pull,
resume), stated as an assumption there too.

    python -m benchmarks.elastic [--quick] [--relaunch-s 600]   # writes benchmarks/results/elastic.json

On a shared 2-core machine the wall times include the other processes' load (the JSON
records the load average at the start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import environment, write_report
from tests.cloud.metadata_server import MetadataServer
from tests.elastic.agents import Agent, records, wait_for
from tests.servers import free_port

RESULTS = Path(__file__).resolve().parent / "results" / "elastic.json"
WIDTHS = (32, 128, 512)
WAYS = ("notice", "sigkill")


def _overrides(folder: Path, width: int, max_steps: int) -> list[str]:
    return [
        f"run_dir={folder / 'run'}", f"checkpoint.root={folder / 'checkpoints'}", f"recipe.width={width}",
        "precision=fp32", f"schedule.max_steps={max_steps}", "schedule.warmup_steps=2", "checkpoint.every_steps=3",
        "checkpoint.every_minutes=null", "monitor.log_every_steps=1", "monitor.tensorboard=false",
        "monitor.report=false", "preemption.cloud=aws", "preemption.poll_interval_s=0.05", "preemption.grace_s=60",
        "distributed.nodes.min=1", "distributed.nodes.max=2", "distributed.nodes.heartbeat_s=1",
        "distributed.nodes.last_call_s=2", "distributed.nodes.rendezvous_timeout_s=60", "distributed.timeout_s=60",
    ]


def measure(width: int, way: str, *, trigger_step: int, max_steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"elastic-{way}-{width}-") as name, MetadataServer() as server:
        folder, port = Path(name), free_port()
        overrides = _overrides(folder, width, max_steps)
        survivor = Agent(folder, "node0", port, overrides, node_rank=0)
        time.sleep(1.0)  # node 0 first: it takes rank 0 and hosts the rendezvous
        lost = Agent(folder, "node1", port, overrides, node_rank=1, endpoint=server.url)
        try:
            run = folder / "run"
            wait_for(lambda: any(r["step"] >= trigger_step for r in records(run, "train")), f"step {trigger_step}",
                     [survivor, lost], timeout_s=600)
            lost_at = time.time()
            server.arm("aws", deadline_in_s=120) if way == "notice" else lost.kill()
            codes = (survivor.wait(timeout_s=900), lost.wait(timeout_s=60))
        finally:
            survivor.kill(), lost.kill()
        assert codes[0] == 0 and codes[1] != 0, (codes, survivor.log[-3000:])
        [change] = records(run, "membership")
        # Every step's checkpoint has the same size; older ones are pruned (checkpoint.keep).
        checkpoint = max((folder / "checkpoints").glob("step-*"), key=lambda path: int(path.name[5:]))
        return {
            "width": width, "way": way, "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.iterdir()),
            "loss_to_next_step_s": round(_first_step_at_one(run, lost_at) - lost_at, 3),
            "seconds_lost": change["seconds_lost"], "steps_lost": change["steps_lost"],
            "resumed_step": change["step"],
        }


def _first_step_at_one(run: Path, lost_at: float) -> float:
    """End of the first step trained by the re-formed job (after its run_start)."""
    restarted = min(r["time"] for r in records(run, "run_start") if r["time"] > lost_at)
    return min(r["time"] for r in records(run, "train") if r["time"] > restarted)


def print_report(config: dict[str, Any], results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="node lost -> survivors' next step (measured)")
    for column in ("way", "width", "checkpoint MiB", "loss -> next step s", "seconds_lost", "steps_lost"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for row in results["runs"]:
        table.add_row(row["way"], str(row["width"]), f"{row['checkpoint_bytes'] / 2**20:.2f}",
                      f"{row['loss_to_next_step_s']:.1f}", f"{row['seconds_lost']:.1f}", str(row["steps_lost"]))
    console = Console(width=140)
    console.print(table)
    # The relaunch is an assumed parameter, not a measurement: it stays out of the results.
    console.print(f"against a whole-job relaunch: relaunch_s = {config['relaunch_s']:g} s ({config['relaunch_s_source']}) "
                  f"plus the same worker start and resume, with all {config['nodes']} nodes idle")


def main(argv: list[str] | None = None) -> int:
    from skylift.plan.ranking import DEFAULT_RESTART_S

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest width only")
    parser.add_argument("--relaunch-s", type=float, default=DEFAULT_RESTART_S,
                        help="seconds a platform takes to relaunch a whole job (default: the planner's assumption)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    widths = WIDTHS[:1] if args.quick else WIDTHS
    config = {"widths": list(widths), "ways": list(WAYS), "trigger_step": 4, "max_steps": 30, "nodes": 2,
              "relaunch_s": args.relaunch_s, "relaunch_s_source": "assumed: skylift.plan.ranking.DEFAULT_RESTART_S",
              "load_average_at_start": list(os.getloadavg()), **environment(1, ("torch",))}
    rows = [measure(width, way, trigger_step=config["trigger_step"], max_steps=config["max_steps"])
            for width in widths for way in WAYS]
    results = {"runs": rows,
               "median_loss_to_next_step_s": {way: statistics.median(r["loss_to_next_step_s"] for r in rows
                                                                     if r["way"] == way) for way in WAYS}}
    write_report(args.output, config, results, started, print_report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

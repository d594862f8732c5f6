"""Elastic ``skylift run --nnodes MIN:MAX`` agents on loopback, one process each.

Every agent is a real ``python -m skylift run`` (skylift's torchrun agent and its worker)
on 127.0.0.2 (``--one-machine``), in a session of its own so a test can SIGKILL a whole node. The nodes share
the run folder and the checkpoint root, as nodes share a bucket (rank 0, on whichever
node it lands, writes ``metrics.jsonl``); each has its own metadata endpoint, so a spot
notice reaches one node only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.checkpoint.runs import EXACT, LEAN
from tests.conftest import REPO_ROOT
from tests.process_family import ProcessFamily

DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens
MASTER = "127.0.0.2"
RECIPE = "recipe.name=tests.elastic.sample_log_recipe:SampleLoggedClassification"
HEARTBEAT_S, LAST_CALL_S = 1, 2
ELASTIC = (
    "preemption.cloud=aws",
    "preemption.poll_interval_s=0.05",
    "preemption.grace_s=20",
    f"distributed.nodes.heartbeat_s={HEARTBEAT_S}",
    f"distributed.nodes.last_call_s={LAST_CALL_S}",
    "distributed.timeout_s=30",
    RECIPE,
)
THREADS = {"OMP_NUM_THREADS": "1"}
"""One thread per worker in every run compared bit for bit: another count sums in another order."""


def job_overrides(folder: Path, low: int, high: int, rendezvous_timeout_s: float = 60) -> list[str]:
    return [*EXACT, *LEAN, *ELASTIC, f"run_dir={folder / 'run'}", f"checkpoint.root={folder / 'checkpoints'}",
            f"distributed.nodes.min={low}", f"distributed.nodes.max={high}",
            f"distributed.nodes.rendezvous_timeout_s={rendezvous_timeout_s}"]


class Agent(ProcessFamily):
    """One node: ``skylift run`` with its own metadata endpoint and log file; :meth:`kill`
    SIGKILLs the whole node (the agent's session and every worker it started)."""

    def __init__(self, folder: Path, name: str, port: int, overrides: list[str], *, node_rank: int,
                 endpoint: str = DEAD_ENDPOINT, env: dict[str, str] | None = None) -> None:
        args = [sys.executable, "-m", "skylift", "run", "examples/quickstart.yaml", "--json", "--no-doctor",
                "--nproc", "1", "--node-rank", str(node_rank), "--master-addr", MASTER, "--master-port", str(port),
                "--one-machine"]
        for override in overrides:
            args += ["--set", override]
        samples = folder / "samples"
        samples.mkdir(exist_ok=True)
        environment = {key: value for key, value in os.environ.items()
                       if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
        environment.update(THREADS, PYTHONUNBUFFERED="1", SKYLIFT_METADATA_ENDPOINT=endpoint,
                           SKYLIFT_TEST_SAMPLE_LOG=str(samples), **(env or {}))
        self.name, self.log_path = name, folder / f"{name}.log"
        with self.log_path.open("w") as log:  # a file: a full pipe would stall the node
            super().__init__(subprocess.Popen(args, cwd=REPO_ROOT, env=environment, stdout=log, stderr=log,
                                              stdin=subprocess.DEVNULL, start_new_session=True))

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float = 300) -> int:
        deadline = time.monotonic() + timeout_s
        while self.popen.poll() is None:
            if time.monotonic() >= deadline:  # a raise, not an assert: a poll is not a check that passed
                raise AssertionError(f"{self.name} still running after {timeout_s} s:\n{self.log[-4000:]}")
            self.remember_family()
            time.sleep(0.2)
        return self.popen.returncode


def records(run_dir: Path, kind: str) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if record.get("kind") == kind:
            found.append(record)
    return found


def wait_for(condition, what: str, agents: list[Agent], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for agent in agents:
            agent.remember_family()
        logs = "\n".join(f"--- {agent.name} ---\n{agent.log[-3000:]}" for agent in agents)
        if time.monotonic() >= deadline:
            raise AssertionError(f"no {what} within {timeout_s} s:\n{logs}")
        if any(agent.popen.poll() is not None for agent in agents):
            raise AssertionError(f"an agent ended before {what}:\n{logs}")
        time.sleep(0.1)


def world_sizes(run_dir: Path) -> list[int]:
    return [record["world_size"] for record in records(run_dir, "run_start")]

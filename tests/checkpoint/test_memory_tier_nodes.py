"""``checkpoint.memory`` end to end: real elastic skylift agents on loopback (gloo, c10d
rendezvous), FSDP2, an S3 root on moto behind a proxy that records every request.

* a whole node SIGKILLed mid-run: the survivor re-forms alone and resumes from memory
  (its own shard and the lost node's, from the replica it received) with no read of a
  checkpoint object; its final weights equal a run resumed from the same step on disk;
* every worker of a one-node job killed (the agent alive, restarting them): the
  restart resumes from the node's own memory, again without reading the root.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpoint.runs import lean_train_here, losses_by_step, summary
from tests.elastic.agents import DEAD_ENDPOINT, RECIPE, THREADS, Agent, job_overrides, records, wait_for
from tests.servers import FaultyProxy, free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


@pytest.fixture
def memory_roots():
    """tmpfs folders, as in production (one per loopback 'node'), removed after the test."""
    base = Path("/dev/shm") / f"skylift-test-{uuid.uuid4().hex[:8]}"
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def counted(moto_server):
    """A proxy in front of moto: every request the job makes, in order."""
    proxy = FaultyProxy(moto_server.port)
    yield proxy
    proxy.close()


def _checkpoint_reads(proxy: FaultyProxy, since: int, until: int | None = None, *, found: bool = False) -> list[str]:
    """Reads of checkpoint objects (``step-N/...``) among the requests ``since:until``
    (``found``: only those the store answered with the object, not a 404)."""
    # strict=False: a request relayed between reading the two lists is in one only; it is past ``until``.
    answered = list(zip(proxy.answered, proxy.statuses, strict=False))[since:until]
    return [path for (method, path, _), status in answered
            if method == "GET" and "/step-" in path and (status == 200 or not found)]  # fmt: skip


def _held_in_memory(memory_root: Path) -> set[int]:
    return {int(path.parent.name.removeprefix("step-")) for path in memory_root.glob("*/step-*/manifest.json")}


def _memory_job(folder: Path, bucket: str, memory_roots: Path, node: int, *extra: str) -> list[str]:
    return [*job_overrides(folder, 1, 2), f"checkpoint.root=s3://{bucket}/memory", "checkpoint.memory.enabled=true",
            f"checkpoint.memory.root={memory_roots / f'node{node}'}", "distributed.strategy=fsdp",
            "checkpoint.keep=20", *extra]  # fmt: skip  (keep: the step resumed stays at the root for the reference)


def test_a_lost_node_resumes_from_its_peers_memory_reading_nothing_and_equals_a_disk_resume(
    moto_server, s3_bucket, counted, memory_roots, tmp_path, cli_here
):
    env = {"SKYLIFT_S3_ENDPOINT_URL": counted.endpoint_url}
    port = free_port()
    first = Agent(tmp_path, "node0", port, _memory_job(tmp_path, s3_bucket, memory_roots, 0), node_rank=0, env=env)
    time.sleep(1.0)  # node 0 joins first: it takes rank 0
    second = Agent(tmp_path, "node1", port, _memory_job(tmp_path, s3_bucket, memory_roots, 1), node_rank=1, env=env)
    try:
        safe = lambda: [r for r in records(tmp_path / "run", "checkpoint") if r.get("safe") and r["step"] >= 14]  # noqa: E731
        wait_for(lambda: bool(safe()), "a safe checkpoint at step 14", [first, second])
        requests_before_kill = len(counted.answered)
        second.kill()
        held = _held_in_memory(memory_roots / "node0")
        # Node 0's memory as the kill left it, on disk: the reference resumes from this copy.
        shutil.copytree(memory_roots / "node0", tmp_path / "memory-at-kill",
                        ignore=shutil.ignore_patterns(".skylift-tmp-*"))
        # The survivor's first step after the resume writes the membership record: the
        # requests up to then are the restore's (later saves list the root's manifests).
        wait_for(lambda: bool(records(tmp_path / "run", "membership")), "the survivor's first step", [first])
        requests_at_first_step = len(counted.answered)
        code = first.wait()
    finally:
        first.kill(), second.kill()
    log = first.log
    assert code == 0, log[-4000:]
    [change] = records(tmp_path / "run", "membership")
    assert (change["reason"], change["old_world_size"], change["new_world_size"]) == ("node_lost", 2, 1)
    resumed = change["step"]
    assert resumed >= 14
    # Every file of the resumed step came from node 0's memory: its own shard and node 1's.
    assert f"step-{resumed}: " in log and "files from the memory copy" in log, log[-4000:]
    line = next(line for line in log.splitlines() if f"resumed from s3://{s3_bucket}/memory/step-{resumed}" in line)
    from_memory, _, total = line.split(": ")[-1].partition(" files")[0].partition(" of ")
    assert from_memory == total, line
    reads = _checkpoint_reads(counted, requests_before_kill, requests_at_first_step)
    found = _checkpoint_reads(counted, requests_before_kill, requests_at_first_step, found=True)
    assert [path for path in found if not path.endswith("/manifest.json")] == [], "a checkpoint file came from S3"
    # A look that found nothing is allowed only for a newer step the kill cut short: node 0
    # committed it in memory, node 1's share never reached it, so the resume asks the root
    # for that share before passing the step over.
    probed = {int(path.split("/step-")[1].split("/")[0]) for path in reads if not path.endswith("/manifest.json")}
    assert all(step > resumed for step in probed), (reads, resumed)
    # Only the manifests of older steps that no memory holds (the root keeps more), for the timeline.
    read_steps = {int(path.split("/step-")[1].split("/")[0]) for path in reads}
    assert resumed in held and not read_steps & held, (reads, held)
    saves = records(tmp_path / "run", "checkpoint")
    assert all(record["safe"] for record in saves if record["step"] <= resumed and record["committed"])

    # The same step, resumed on one process from a folder on disk holding it (node 0's
    # memory as the kill left it: the step may never have reached the root).
    reference = tmp_path / "reference"
    [step_copy] = (tmp_path / "memory-at-kill").glob(f"*/step-{resumed}")
    shutil.copytree(step_copy, reference / "checkpoints" / f"step-{resumed}")
    shared = [RECIPE, "distributed.timeout_s=30", "distributed.strategy=fsdp", "checkpoint.every_steps=7"]
    disk = lean_train_here(cli_here, reference / "run", *shared, f"checkpoint.root={reference / 'checkpoints'}",
                           env={**THREADS, "SKYLIFT_METADATA_ENDPOINT": DEAD_ENDPOINT})
    assert disk.returncode == 0, disk.stderr[-3000:]
    assert summary(reference / "run")["resumed_from_step"] == resumed
    got, want = load_file(tmp_path / "run" / "model.safetensors"), load_file(reference / "run" / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    after = {step: loss for step, loss in losses_by_step(tmp_path / "run").items() if step > resumed}
    assert after == losses_by_step(reference / "run") and after


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_workers_killed_on_a_node_whose_agent_lives_resume_from_its_own_memory(
    s3_bucket, counted, memory_roots, tmp_path, strategy
):
    # The worker dies after step 17 in its first attempt only; its agent restarts it.
    env = {"SKYLIFT_S3_ENDPOINT_URL": counted.endpoint_url, "SKYLIFT_FAULT_INJECTION": "step_end:step=17:restart=0"}
    overrides = [*_memory_job(tmp_path, s3_bucket, memory_roots, 0),  # elastic (1 to 2 nodes), one joins
                 f"distributed.strategy={strategy}"]  # fmt: skip
    node = Agent(tmp_path, "node0", free_port(), overrides, node_rank=0, env=env)
    try:
        wait_for(lambda: "workers failed" in node.log, "the worker's crash", [node])
        requests_at_crash = len(counted.answered)
        wait_for(lambda: "resumed from" in node.log, "the restarted worker's resume", [node])
        requests_at_resume = len(counted.answered)
        code = node.wait()
    finally:
        node.kill()
    assert code == 0, node.log[-4000:]
    assert summary(tmp_path / "run")["steps"] == 60
    line = next(line for line in node.log.splitlines() if "resumed from" in line)
    assert "step-14: " in line and "files from the memory copy" in line, line
    from_memory, _, total = line.split(": ")[-1].partition(" files")[0].partition(" of ")
    assert from_memory == total, line
    assert _checkpoint_reads(counted, requests_at_crash, requests_at_resume) == [], "the restore read the root"
    # The run ended with its last checkpoint durable: the node's memory is handed back.
    assert "released" in node.log and not list((memory_roots / "node0").glob("*/step-*"))

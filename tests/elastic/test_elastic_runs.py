"""Elastic jobs end to end: real skylift torchrun agents on loopback (gloo, c10d rendezvous).

* a spot notice on one node: it leaves (143), the other continues at world size 1 without
  its agent exiting, every sample of each epoch is trained exactly once, and the final
  weights equal bit for bit a run that changed world size at the same step by
  stop-and-resume (two processes killed after that step's commit, resumed in one);
* SIGKILL of a whole node mid-run: the survivor continues from the newest complete
  checkpoint within the stated bound;
* a node joining a running job: it grows back at the next boundary;
* below ``min``: the survivor stops with its committed checkpoint and exit 143.
"""

from __future__ import annotations

import json
import time

import pytest

from skylift.errors import EXIT_REQUEUE
from tests.checkpoint.runs import assert_same_run, lean_train, lean_train_here, summary
from tests.cloud.metadata_server import MetadataServer
from tests.elastic.agents import (
    DEAD_ENDPOINT,
    HEARTBEAT_S,
    LAST_CALL_S,
    RECIPE,
    THREADS,
    Agent,
    job_overrides,
    records,
    wait_for,
)
from tests.elastic.sample_log_recipe import logged_samples
from tests.servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MAX_STEPS, STEPS_PER_EPOCH, GLOBAL_BATCH = 60, 22, 64  # EXACT's 60 steps; 1,437 digits // 64 per epoch
GROW_STEPS, HELD_AFTER = 40, 12
"""The growing job's steps, and the step after which its first node, alone, waits for the join."""
START_BUDGET_S = 60.0
"""Worker start and resume on the 2-core reference machine under the other tests' load
(measured about 8 s unloaded): the allowance the bounds below add for it."""


def _two_nodes(folder, low, high, *extra, noticed_node=1, **kwargs):
    """Node 0 (the rendezvous host) and node 1; ``noticed_node``'s metadata endpoint is the server."""
    port, overrides = free_port(), [*job_overrides(folder, low, high, **kwargs), *extra]
    server = MetadataServer().__enter__()
    endpoints = {noticed_node: server.url}
    first = Agent(folder, "node0", port, overrides, node_rank=0, endpoint=endpoints.get(0, DEAD_ENDPOINT))
    time.sleep(1.0)  # node 0 joins first: the lower pid takes rank 0 (c10d sorts by address, then pid)
    second = Agent(folder, "node1", port, overrides, node_rank=1, endpoint=endpoints.get(1, DEAD_ENDPOINT))
    return server, first, second, port, overrides


def _after_step(folder, step, agents):
    wait_for(lambda: any(record["step"] >= step for record in records(folder / "run", "train")),
             f"step {step}", agents)


@pytest.fixture(scope="module")
def noticed(tmp_path_factory):
    """Node 1 gets an AWS spot notice after step 15: (folder, node 0's code, node 1's code)."""
    folder = tmp_path_factory.mktemp("elastic-notice")
    server, first, second, _, _ = _two_nodes(folder, 1, 2)
    try:
        _after_step(folder, 15, [first, second])
        server.arm("aws", deadline_in_s=90)
        codes = second.wait(), first.wait()
    finally:
        first.kill(), second.kill(), server.__exit__(None, None, None)
    return folder, codes, first.log, second.log


def test_the_noticed_node_leaves_and_the_other_finishes_at_world_size_one(noticed):
    folder, (left, stayed), stayed_log, left_log = noticed
    assert (left, stayed) == (EXIT_REQUEUE, 0), stayed_log[-3000:] + left_log[-3000:]
    assert "it leaves the job" in left_log
    assert "for another node's notice; restarting the workers" in stayed_log
    assert [record["world_size"] for record in records(folder / "run", "run_start")] == [2, 1]
    assert summary(folder / "run")["steps"] == MAX_STEPS


def test_the_membership_record_says_what_changed(noticed):
    folder = noticed[0]
    [stop] = records(folder / "run", "preemption")
    [change] = records(folder / "run", "membership")
    assert (change["step"], change["reason"], change["steps_lost"]) == (stop["checkpoint_step"], "notice", 0)
    sizes = (change["old_world_size"], change["new_world_size"], change["old_nodes"], change["new_nodes"])
    assert sizes == (2, 1, 2, 1)
    # Lost: the rendezvous' last call for more nodes, then worker start and resume.
    assert LAST_CALL_S <= change["seconds_lost"] < LAST_CALL_S + START_BUDGET_S


def test_every_sample_of_each_epoch_is_trained_exactly_once(noticed):
    folder = noticed[0]
    stop = records(folder / "run", "preemption")[0]["checkpoint_step"]
    by_step: dict[int, list[int]] = {}
    for path in sorted((folder / "samples").glob("samples-*.txt")):
        lines = path.read_text().splitlines()
        # One line per micro-batch and one micro-batch per step at both sizes (64 over 2
        # ranks, then 64 on 1): the first attempt's files hold steps 1..stop, the survivor's
        # last attempt stop+1..60.
        assert len(lines) in (stop, MAX_STEPS - stop), (path, len(lines))
        first_step = 1 if len(lines) == stop else stop + 1
        for offset, line in enumerate(lines):
            by_step.setdefault(first_step + offset, []).extend(int(part) for part in line.split())
    assert sorted(by_step) == list(range(1, MAX_STEPS + 1))
    assert all(len(ids) == GLOBAL_BATCH for ids in by_step.values())
    for epoch in range(MAX_STEPS // STEPS_PER_EPOCH + 1):
        steps = [step for step in by_step if (step - 1) // STEPS_PER_EPOCH == epoch]
        ids = [index for step in steps for index in by_step[step]]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample trained twice"
        if len(steps) == STEPS_PER_EPOCH:
            assert len(ids) == STEPS_PER_EPOCH * GLOBAL_BATCH
    assert len(logged_samples(folder / "samples")) == MAX_STEPS * GLOBAL_BATCH  # nothing else was trained


def test_the_weights_equal_a_stop_and_resume_at_the_same_step(noticed, cli_here, tmp_path):
    """Two processes to the stop step (killed after its commit), then one: the existing
    resume path, with the same arithmetic (one thread per worker) as the elastic job. The
    resume in this process: only its output is read (a Python start with torch saved)."""
    folder = noticed[0]
    stop = records(folder / "run", "preemption")[0]["checkpoint_step"]
    reference = tmp_path / "run"
    # The elastic job's recipe and collective timeout, not its distributed.nodes (a fixed size here).
    shared = [RECIPE, "distributed.timeout_s=30", f"checkpoint.every_steps={stop}", "checkpoint.async_save=false"]
    quiet = {**THREADS, "SKYLIFT_METADATA_ENDPOINT": DEAD_ENDPOINT}
    killed = lean_train(reference, *shared, nproc=2,
                        env={**quiet, "SKYLIFT_FAULT_INJECTION": f"step_end:step={stop + 1}:rank=0"})
    assert killed.returncode != 0
    resumed = lean_train_here(cli_here, reference, *shared, env=quiet)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(reference)["resumed_from_step"] == stop
    assert_same_run(folder / "run", reference)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Node 1's agent and workers SIGKILLed after step 15: (folder, node 0's code, its log, kill time)."""
    folder = tmp_path_factory.mktemp("elastic-kill")
    server, first, second, _, _ = _two_nodes(folder, 1, 2, "checkpoint.keep=20")  # every manifest stays to check
    try:
        _after_step(folder, 15, [first, second])
        killed_at = time.time()
        second.kill()
        code = first.wait()
    finally:
        first.kill(), second.kill(), server.__exit__(None, None, None)
    return folder, code, first.log, killed_at


def test_a_killed_node_costs_a_bounded_time_and_the_survivor_finishes(killed):
    folder, code, log, killed_at = killed
    assert code == 0, log[-4000:]
    [change] = records(folder / "run", "membership")
    assert (change["reason"], change["old_world_size"], change["new_world_size"]) == ("node_lost", 2, 1)
    # The newest checkpoint complete when the survivor resumed: its manifest (written last) is
    # older than the record, written at the end of the resumed attempt's first step (its own
    # next save is steps later). That can be one whose manifest came after the kill: once
    # every rank has voted its files in, rank 0 writes the manifest, and a node lost after its
    # vote takes nothing with it (on a loaded machine the kill lands there often).
    manifests = [json.loads(path.read_text()) for path in (folder / "checkpoints").glob("step-*/manifest.json")]
    assert change["step"] == max(manifest["step"] for manifest in manifests if manifest["created_at"] < change["time"])
    assert change["step"] >= max(manifest["step"] for manifest in manifests if manifest["created_at"] < killed_at)
    # The bound: gloo sees the closed socket at once (else distributed.timeout_s=30), the
    # rendezvous drops the dead node after 3 missed keep-alives, waits its last call, then
    # worker start and resume.
    first_step_after = min(record["time"] for record in records(folder / "run", "train") if record["time"] > killed_at)
    bound_s = 30 + 3 * HEARTBEAT_S + LAST_CALL_S + START_BUDGET_S
    assert first_step_after - killed_at < bound_s
    assert summary(folder / "run")["steps"] == MAX_STEPS


def test_a_joining_node_grows_the_job_back_at_a_boundary(tmp_path):
    # Node 0, alone, holds in the step after HELD_AFTER until the SIGTERM torchrun sends it for
    # the joining node: the second node's start (Python and torch, ~10 s loaded) finds it running
    # on any machine. A step count alone did not: 300 steps took 3.8 s on a fast one.
    port, overrides = free_port(), [*job_overrides(tmp_path, 1, 2), f"schedule.max_steps={GROW_STEPS}"]
    first = Agent(tmp_path, "node0", port, overrides, node_rank=0,
                  env={"SKYLIFT_TEST_HOLD_ALONE_AFTER": str(HELD_AFTER)})
    try:
        _after_step(tmp_path, 10, [first])
        second = Agent(tmp_path, "node1", port, overrides, node_rank=1)
        try:
            assert (first.wait(), second.wait()) == (0, 0), first.log[-3000:] + second.log[-3000:]
        finally:
            second.kill()
    finally:
        first.kill()
    assert [record["world_size"] for record in records(tmp_path / "run", "run_start")] == [1, 2]
    [change] = records(tmp_path / "run", "membership")
    assert (change["reason"], change["old_world_size"], change["new_world_size"]) == ("node_joined", 1, 2)
    assert change["steps_lost"] == 0
    [stop] = records(tmp_path / "run", "preemption")  # the SIGTERM torchrun sends for the joining node
    assert change["step"] == stop["checkpoint_step"] <= HELD_AFTER + 1  # node 0 never trained past its hold alone
    assert summary(tmp_path / "run")["steps"] == GROW_STEPS


def test_below_min_the_survivor_stops_with_its_checkpoint_and_143(tmp_path):
    server, first, second, _, _ = _two_nodes(tmp_path, 2, 2, rendezvous_timeout_s=5)
    try:
        _after_step(tmp_path, 10, [first, second])
        server.arm("aws", deadline_in_s=90)
        codes = second.wait(), first.wait()
    finally:
        first.kill(), second.kill(), server.__exit__(None, None, None)
    assert codes == (EXIT_REQUEUE, EXIT_REQUEUE), first.log[-3000:]
    assert "fewer than distributed.nodes.min=2 nodes joined" in first.log
    [stop] = records(tmp_path / "run", "preemption")
    assert stop["saved"] and (tmp_path / "checkpoints" / f"step-{stop['checkpoint_step']}" / "manifest.json").exists()


def test_a_notice_on_the_rendezvous_host_stops_the_whole_job_with_143(tmp_path):
    """Node 0 hosts the rendezvous store: when it leaves nobody can re-form, so every node
    requeues with the committed checkpoint (the docs say: put node 0 on on-demand capacity)."""
    server, first, second, _, _ = _two_nodes(tmp_path, 1, 2, noticed_node=0)
    try:
        _after_step(tmp_path, 10, [first, second])
        server.arm("aws", deadline_in_s=90)
        codes = first.wait(), second.wait()
    finally:
        first.kill(), second.kill(), server.__exit__(None, None, None)
    assert codes == (EXIT_REQUEUE, EXIT_REQUEUE), second.log[-3000:]
    assert "it leaves the job" in first.log and "the rendezvous on 127.0.0.2" in second.log
    [stop] = records(tmp_path / "run", "preemption")
    assert stop["saved"] and (tmp_path / "checkpoints" / f"step-{stop['checkpoint_step']}" / "manifest.json").exists()

"""Fast lane: ``--nnodes MIN:MAX`` and ``distributed.nodes`` into torchrun's c10d arguments,
their conflicts, and how skylift's agent reads a worker group's exit codes."""

from __future__ import annotations

import pytest

from skylift.config.distributed import ElasticNodes
from skylift.errors import SkyliftConfigError
from skylift.launch.elastic import elastic_torchrun_arguments, parse_nnodes, rendezvous_id, resolve_nodes
from skylift.launch.launcher import Topology


@pytest.mark.parametrize(("text", "parsed"), [("1:4", (1, 4)), ("3", (3, None)), ("2:2", (2, 2))])
def test_nnodes_is_a_count_or_min_max(text, parsed):
    assert parse_nnodes(text) == parsed


@pytest.mark.parametrize("text", ["4:1", "0:2", "a:b", "1:2:3", "", "-1"])
def test_a_bad_nnodes_names_the_flag_and_the_form(text):
    with pytest.raises(SkyliftConfigError, match="--nnodes") as raised:
        parse_nnodes(text)
    assert "MIN:MAX" in str(raised.value)


def test_the_flag_and_the_config_must_agree():
    configured = ElasticNodes(min=1, max=4)
    assert resolve_nodes("1:4", configured) is configured
    assert resolve_nodes(None, configured) is configured
    assert resolve_nodes("1:3", None) == ElasticNodes(min=1, max=3)
    assert resolve_nodes("2", None) is None  # a fixed size stays on the static rendezvous
    for flag in ("1:3", "4"):
        with pytest.raises(SkyliftConfigError) as raised:
            resolve_nodes(flag, configured)
        assert f"--nnodes {flag}" in str(raised.value) and "distributed.nodes {min: 1, max: 4}" in str(raised.value)


def test_an_elastic_topology_takes_c10d_with_the_configured_timeouts():
    nodes = ElasticNodes(min=1, max=4, rendezvous_timeout_s=120, heartbeat_s=2.5, last_call_s=10, max_failures=5)
    host = Topology(nproc=8, nnodes=4, node_rank=0, master_addr="10.0.0.5", master_port=29500, grace_s=110,
                    elastic=nodes)
    argv = elastic_torchrun_arguments(host, ["skylift.cli.worker", "job.yaml"], module=True, port=29500)
    assert argv[:5] == ["--nproc-per-node=8", "--nnodes=1:4", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.5:29500",
                        f"--rdzv-id={rendezvous_id('10.0.0.5', 29500)}"]
    # whole seconds for torchrun, rounded up (2.5 s -> 3 s)
    assert ("--rdzv-conf=is_host=true,join_timeout=120,last_call_timeout=10,keep_alive_interval=3,"
            "keep_alive_max_attempt=3") in argv
    assert "--max-restarts=5" in argv and "--shutdown-timeout=110" in argv
    assert argv[-3:] == ["-m", "skylift.cli.worker", "job.yaml"]
    assert not any(arg.startswith("--local-addr") for arg in argv)  # off loopback: the host's own name
    other = Topology(nproc=8, nnodes=4, node_rank=2, master_addr="10.0.0.5", master_port=29500, elastic=nodes)
    assert "is_host=false" in " ".join(elastic_torchrun_arguments(other, ["x"], module=True, port=29500))


def test_every_node_names_the_same_rendezvous_and_jobs_differ(monkeypatch):
    monkeypatch.delenv("SKYLIFT_JOB_ID", raising=False)
    assert rendezvous_id("10.0.0.5", 29500) == rendezvous_id("10.0.0.5", 29500) != rendezvous_id("10.0.0.5", 29501)
    monkeypatch.setenv("SKYLIFT_JOB_ID", "train-42")
    assert rendezvous_id("10.0.0.5", 29500) == rendezvous_id("10.0.0.6", 29501)  # the job id names it


def test_launch_dry_run_prints_the_c10d_command(cli_here, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    result = cli_here("launch", "--nproc", "2", "--nnodes", "1:4", "--node-rank", "1", "--master-addr", "10.0.0.5",
                      "--master-port", "29500", "--dry-run", "--", "python", str(script))
    assert result.returncode == 0, result.stderr
    assert "--nnodes=1:4 --rdzv-backend=c10d --rdzv-endpoint=10.0.0.5:29500" in result.stdout
    assert "is_host=false" in result.stdout


def test_run_refuses_a_flag_that_contradicts_the_config(cli_here):
    result = cli_here("run", "examples/quickstart.yaml", "--nnodes", "1:2", "--set", "distributed.nodes.max=3",
                      "--dry-run")
    assert result.returncode == 2
    assert "--nnodes 1:2 and distributed.nodes {min: 1, max: 3} disagree" in result.stderr


def _result(*codes: int):
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {rank: ProcessFailure(rank, 1000 + rank, code, "") for rank, code in enumerate(codes)}
    return RunResult(state=WorkerState.FAILED, failures=failures)


def test_a_committed_stop_is_143_with_the_rest_ended_by_the_agent():
    from skylift.launch.elastic_agent import committed_stop

    assert committed_stop(_result(143))
    assert committed_stop(_result(143, -15))  # the agent closed the other worker once one exited
    assert not committed_stop(_result(1))  # a crash (a lost peer's gloo error)
    assert not committed_stop(_result(143, 1))
    assert not committed_stop(_result(-9))  # killed: nothing says its checkpoint committed


def test_an_elastic_attempt_takes_over_its_own_jobs_lease_and_no_other(tmp_path):
    """After a node is lost, the new rank 0 may sit on another host than the old one, whose
    lease then looks live for ``lease_ttl_s``: the same elastic job id takes it over."""
    import json
    import time

    from skylift.checkpoint.lease import LeaseHeldError, RunLease, lease_generations, lease_key
    from skylift.storage import open_store

    store = open_store(str(tmp_path / "root"))
    job = rendezvous_id("10.0.0.5", 29500)
    live_elsewhere = {"owner": "old-rank-0", "host": "a-lost-node", "pid": 4242, "heartbeat_time": time.time(),
                      "ttl_s": 60.0}
    def plant(job_id):  # a live holder on another host, as the lease's next generation
        generation = max(lease_generations(store), default=0) + 1
        store.write_bytes(lease_key(generation), json.dumps({**live_elsewhere, "job_id": job_id}).encode())

    plant(job)
    lease = RunLease(store, job_id=job)
    lease.acquire()
    lease.release()
    plant(rendezvous_id("10.0.0.9", 29500))
    with pytest.raises(LeaseHeldError):
        RunLease(store, job_id=job).acquire()
    plant("none")
    with pytest.raises(LeaseHeldError):  # torchrun's default run id is shared by unrelated static jobs
        RunLease(store, job_id="none").acquire()


def test_the_torch_internals_the_agent_relies_on_are_there():
    """skylift's agent re-uses torchrun's loop pieces by name (torch 2.14); an upgrade that
    renames one fails here, not in a lost node on a cluster."""
    import inspect

    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.launcher import api as launcher_api

    for name in ("_initialize_workers", "_monitor_workers", "_restart_workers", "_exit_barrier"):
        assert callable(getattr(SimpleElasticAgent, name, None)), name
    assert "_remaining_restarts" in inspect.getsource(SimpleElasticAgent.__init__)
    handler = dynamic_rendezvous.DynamicRendezvousHandler
    assert callable(handler._stop_heartbeats) and "_op_executor" in inspect.getsource(handler.__init__)
    assert callable(dynamic_rendezvous._RendezvousExitOp) and callable(launcher_api._get_addr_and_port)
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert "timeout" in inspect.signature(LocalElasticAgent._shutdown).parameters

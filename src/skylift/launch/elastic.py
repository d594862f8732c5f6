"""Elastic node counts on torchrun's own c10d rendezvous (``--nnodes MIN:MAX``).

skylift drives torchrun's ``LocalElasticAgent`` the way
``torch.distributed.launcher.api.launch_agent`` does, with one small subclass that tells
apart the three ways a worker group ends before its time:

* its workers exited 143 after an agreed, committed stop and THIS node got the spot
  notice (its local rank 0 wrote the notice marker): the agent leaves (exit 143) without
  closing the rendezvous, so the survivors re-form without it;
* they exited 143 after a committed stop for another node's notice: restart at the new
  size, not counted as a failure (torchrun would count it);
* anything else (a peer vanished: gloo's error or timeout): a failure, counted against
  ``distributed.nodes.max_failures``, and the workers resume from the newest complete
  checkpoint.

A node that joins makes torchrun's agents restart a healthy group (SIGTERM: skylift's
workers checkpoint at the next step boundary). Workers learn why they were restarted
from :data:`RESTART_REASON_VARIABLE`, which the agent sets in its environment (torchrun's
workers inherit it) before it restarts them.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skylift.config.distributed import ElasticNodes

from skylift.errors import EXIT_REQUEUE
from skylift.train.elastic_environment import (
    ELASTIC_DIR_VARIABLE,
    KEEP_ALIVE_ATTEMPTS,
    NOTICE_MARKER,
    RESTART_REASON_VARIABLE,
)

__all__ = ["elastic_torchrun_arguments", "launch_elastic", "parse_nnodes", "rendezvous_id", "resolve_nodes"]


def parse_nnodes(text: str) -> tuple[int, int | None]:
    """``"4"`` -> (4, None); ``"1:4"`` -> (1, 4). Raises SkyliftConfigError naming ``--nnodes``."""
    from skylift.errors import SkyliftConfigError

    parts = text.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (1, 2) or min(numbers, default=0) < 1 or (len(numbers) == 2 and numbers[0] > numbers[1]):
        raise SkyliftConfigError(f"--nnodes {text!r} is neither a node count nor MIN:MAX with 1 <= MIN <= MAX",
                                 hint="Examples: --nnodes 2 (fixed), --nnodes 1:4 (elastic: continue on 1 to 4 nodes)")
    return (numbers[0], None) if len(numbers) == 1 else (numbers[0], numbers[1])


def resolve_nodes(flag: str | None, configured: ElasticNodes | None) -> ElasticNodes | None:
    """The elastic node count from ``--nnodes`` and ``distributed.nodes``; None: a fixed size.

    Raises:
        SkyliftConfigError: the two disagree (both named, with the fix).
    """
    from skylift.config.distributed import ElasticNodes
    from skylift.errors import SkyliftConfigError

    if flag is None:
        return configured
    low, high = parse_nnodes(flag)
    if configured is None:
        return None if high is None else ElasticNodes(min=low, max=high)
    if high is None or (low, high) != (configured.min, configured.max):
        raise SkyliftConfigError(
            f"--nnodes {flag} and distributed.nodes {{min: {configured.min}, max: {configured.max}}} disagree",
            hint=f"Give one of them: drop --nnodes, or pass --nnodes {configured.min}:{configured.max}, "
                 "or remove distributed.nodes from the config for a fixed size.")
    return configured


def rendezvous_id(master_addr: str, master_port: int) -> str:
    """The same id on every node of one job, without talking: the rendezvous host's address
    and port name the job (a job id, ``SKYLIFT_JOB_ID`` or the operator's ``PET_RDZV_ID``, when there is one)."""
    job = os.environ.get("SKYLIFT_JOB_ID") or os.environ.get("PET_RDZV_ID") or f"{master_addr}:{master_port}"
    return "skylift-" + hashlib.sha256(job.encode()).hexdigest()[:16]


def _seconds(value: float) -> int:
    # torchrun reads its rendezvous timeouts as whole seconds; rounding up never shortens one.
    return max(1, math.ceil(value))


def elastic_torchrun_arguments(topology: Any, entry: list[str], *, module: bool, port: int) -> list[str]:
    """torchrun's argv for ``topology`` (a launcher ``Topology`` with ``elastic`` set; not
    imported here, the launcher imports this module): c10d rendezvous on the master."""
    nodes = topology.elastic
    assert nodes is not None
    conf: dict[str, str | int] = {}
    if not topology.rendezvous_host_by_name:
        conf["is_host"] = "true" if topology.node_rank == 0 else "false"
    conf |= {  # node 0 serves the TCPStore (or, without a node rank, the endpoint's host)
        "join_timeout": _seconds(nodes.rendezvous_timeout_s),
        "last_call_timeout": _seconds(nodes.last_call_s),
        "keep_alive_interval": _seconds(nodes.heartbeat_s),
        "keep_alive_max_attempt": KEEP_ALIVE_ATTEMPTS,
    }
    argv = [
        f"--nproc-per-node={topology.nproc}",
        f"--nnodes={nodes.min}:{nodes.max}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={topology.master_addr}:{port}",
        f"--rdzv-id={rendezvous_id(topology.master_addr, port)}",
        "--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in conf.items()),
        f"--max-restarts={nodes.max_failures}",
        f"--shutdown-timeout={max(1, round(topology.resolved_grace_s()))}",
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    ]
    if topology.local_addr is not None:
        argv.append(f"--local-addr={topology.local_addr}")
    return argv + (["-m"] if module else []) + entry


def launch_elastic(topology: Any, entry: list[str], *, module: bool, port: int, preloaded: bool = False) -> int:
    """Run this node's agent in the elastic job; return its exit code (0, 143, a failure's).

    ``preloaded``: the workers are forks of the preloaded server, as in
    :func:`skylift.launch.launcher.launch_workers`; a restart forks them again.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import config_from_args, get_args_parser

    args = get_args_parser().parse_args(elastic_torchrun_arguments(topology, entry, module=module, port=port))
    config, command, command_args = config_from_args(args)
    if preloaded:
        from skylift.launch.preloaded_workers import PreloadedWorker

        config.start_method, command, command_args = "forkserver", PreloadedWorker(entry[0]), entry[1:]
    # torch 2.14's shared agent TCPStore publishes the workers' MASTER_ADDR/PORT only in the
    # first round (DynamicRendezvousHandler caches it), so a node joining a later round waits
    # for keys nobody writes. Unshared, rank 0 publishes them every round.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    folder = Path(tempfile.mkdtemp(prefix="skylift-elastic-"))
    os.environ[ELASTIC_DIR_VARIABLE] = str(folder)
    os.environ.pop(RESTART_REASON_VARIABLE, None)
    agent, handler = _build_agent(config, command, command_args, folder)
    nodes = topology.elastic
    try:
        result = agent.run()
    except SignalException as error:
        print(f"skylift: {error.sigval.name} received; workers stopped; exit {EXIT_REQUEUE} (requeue)", file=sys.stderr)
        return EXIT_REQUEUE
    except RendezvousTimeoutError:
        print(f"skylift: fewer than distributed.nodes.min={nodes.min} nodes joined within "
              f"rendezvous_timeout_s={nodes.rendezvous_timeout_s:g}; the last checkpoint is committed; "
              f"exit {EXIT_REQUEUE} (requeue to resume)", file=sys.stderr)
        return EXIT_REQUEUE
    except RendezvousError as error:  # the host left (its own notice) or is gone
        print(f"skylift: the rendezvous on {topology.master_addr}:{port} ended ({type(error).__name__}: {error}); "
              f"exit {EXIT_REQUEUE} (requeue to resume from the last checkpoint)", file=sys.stderr)
        return EXIT_REQUEUE
    finally:
        _remove(folder)
    return _outcome(agent, result, handler)


def _outcome(agent: Any, result: Any, handler: Any) -> int:
    if result is None:  # a spare the finished job never needed: torchrun's graceful exit
        print("skylift: the job finished without this node (it waited as a spare); exit 0", file=sys.stderr)
        return 0
    if not result.is_failed():
        handler.shutdown()  # closes the rendezvous: spares still waiting exit too
        return 0
    if agent.left:
        print(f"skylift: this node got the spot notice; its workers saved and stopped; it leaves the job "
              f"(the others continue); exit {EXIT_REQUEUE}", file=sys.stderr)
        return EXIT_REQUEUE
    failure = min(result.failures.values(), key=lambda failure: failure.timestamp)
    code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    print(f"skylift: workers stopped with exit code {code} after {agent.failures} restart(s) for failures; "
          f"exit {code}", file=sys.stderr)
    return code


def _build_agent(config: Any, command: Any, command_args: list[str], folder: Path) -> tuple[Any, Any]:
    """What ``launch_agent`` builds (a rendezvous handler and the worker spec), with skylift's agent."""
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
    from torch.distributed.launcher.api import _get_addr_and_port

    from skylift.launch.elastic_agent import SkyliftAgent

    parameters = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                      run_id=config.run_id, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
                                      local_addr=config.local_addr, **config.rdzv_configs)  # fmt: skip
    master_addr, master_port = _get_addr_and_port(parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    handler = registry.get_rendezvous_handler(parameters)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=command,
                      args=tuple(command_args), rdzv_handler=handler, max_restarts=config.max_restarts,
                      monitor_interval=config.monitor_interval, master_addr=master_addr, master_port=master_port,
                      local_addr=config.local_addr)  # fmt: skip
    metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
    agent = SkyliftAgent(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                         log_line_prefix_template=config.log_line_prefix_template,
                         shutdown_timeout=config.shutdown_timeout, notice_marker=folder / NOTICE_MARKER)  # fmt: skip
    return agent, handler


def _remove(folder: Path) -> None:
    for path in folder.iterdir():
        path.unlink(missing_ok=True)
    folder.rmdir()


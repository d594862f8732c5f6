"""Start workers through PyTorch's own launcher (torchrun's elastic agent).

skylift builds torchrun's arguments and calls ``torch.distributed.run`` in this
process, so it is exactly torchrun underneath: same rendezvous, same environment,
same failure handling. Static rendezvous (``--master-addr/--master-port``) is used
for a fixed node count because with ``--rdzv-backend c10d`` torchrun ignores
``--node-rank`` and numbers nodes by join order; an elastic count (``--nnodes MIN:MAX``)
takes c10d (:mod:`skylift.launch.elastic`).
"""

from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skylift.config.distributed import ElasticNodes
    from skylift.machine.facts import Facts

__all__ = ["Topology", "image_script_command", "launch_workers", "script_arguments", "torchrun_arguments"]

# python, python3, python3.11, this interpreter's name: each worker runs its own Python.
_PYTHON_NAME = re.compile(r"python[\d.]*$")


@dataclass(frozen=True)
class Topology:
    """How many processes on how many nodes, and where rank 0's node listens."""

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    grace_s: float | None = None
    """Seconds between forwarding SIGTERM to the workers and killing them; None: the
    detected cloud's notice window (30 s off-cloud), not torchrun's fixed 30 s."""
    elastic: ElasticNodes | None = None
    """An elastic node count (``nnodes`` is then its ``max``); None: exactly ``nnodes``."""
    rendezvous_host_by_name: bool = False
    """Elastic only: whether this node hosts the rendezvous is decided by torch from the
    endpoint's host name (the platform gave no node rank), not by ``node_rank == 0``."""
    one_machine: bool = False
    """``--one-machine``: every node of a multi-node or elastic job is a command on this
    machine (a rehearsal), so the master is a loopback address. Without it a loopback
    master with ``nnodes > 1`` is refused: on a cluster each node would wait for itself."""

    @property
    def local_addr(self) -> str | None:
        """This agent's address in an elastic rendezvous: the master's on loopback (one
        machine), else None (torchrun takes the host's name)."""
        return self.master_addr if self.elastic is not None and _is_loopback(self.master_addr) else None

    def resolved_grace_s(self) -> float:
        if self.grace_s is not None:
            return self.grace_s
        from skylift.cloud.notice import DEFAULT_SIGNAL_GRACE_S, NOTICE_WINDOW_S, detect_cloud

        return NOTICE_WINDOW_S.get(detect_cloud() or "", DEFAULT_SIGNAL_GRACE_S)

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def validate(self) -> None:
        from skylift.errors import SkyliftConfigError

        problems = []
        if self.nproc < 1:
            problems.append(f"--nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            problems.append(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            problems.append(f"--node-rank must be in [0, {self.nnodes - 1}], got {self.node_rank}")
        if self.elastic is not None and self.nnodes != self.elastic.max:
            problems.append(f"--nnodes {self.nnodes} and the elastic maximum {self.elastic.max} disagree")
        if self.nnodes > 1 and self.master_port is None:
            problems.append("--master-port is required with --nnodes > 1 (the same port on every node)")
        loopback = _is_loopback(self.master_addr)
        if self.nnodes > 1 and loopback and not self.one_machine:
            problems.append(f"--master-addr {self.master_addr} is this machine's loopback: with --nnodes > 1 it must "
                            "be node 0's address, reachable from every node")
        if self.one_machine and not loopback:
            problems.append(f"--one-machine runs every node on this machine: --master-addr must be a loopback "
                            f"address (127.0.0.1), got {self.master_addr}")
        if problems:
            raise SkyliftConfigError(problems, hint=(
                "Example: skylift run CONFIG --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.5 "
                "--master-port 29500. To rehearse a multi-node or elastic job on one machine, start one command "
                "per node here, each with --one-machine --master-addr 127.0.0.1 --master-port 29500 and its own "
                "--node-rank (elastic: --nnodes MIN:MAX)"))


def script_arguments(command: list[str] | tuple[str, ...]) -> list[str]:
    """What follows ``--``, as the shim runs it: ``SCRIPT ARGS`` or ``-m MODULE ARGS``.

    A leading ``--`` and the interpreter (``python``, ``python3``, this one's path) go:
    every worker runs the image's or this machine's own Python.
    """
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if command and (_PYTHON_NAME.match(os.path.basename(command[0])) or command[0] == sys.executable):
        command = command[1:]
    return command


def image_script_command(command: list[str] | tuple[str, ...], project: Path, *,
                         check_file: bool = True) -> tuple[str, ...]:
    """The script command as an image built from ``project`` runs it: ``python SCRIPT ARGS``
    with SCRIPT relative to the project (the image's working folder), or ``python -m MODULE ARGS``.

    Raises:
        SkyliftConfigError: no script, a script that is not a file (``check_file``), or
            one outside ``project``, which the image would not contain.
    """
    from skylift.errors import SkyliftConfigError

    arguments = script_arguments(command)
    example = "Example: -- python train.py --epochs 3   (or -- -m my_package.train)"
    if not arguments or (arguments[0] == "-m" and len(arguments) < 2):
        raise SkyliftConfigError("no script after --", hint=example)
    if arguments[0] == "-m":
        return ("python", *arguments)  # a module may come from an installed package: not checked here
    script, *rest = arguments
    path = (project / script).resolve()
    if check_file and not path.is_file():
        raise SkyliftConfigError(f"script {script!r} does not exist in {project}",
                                 hint=f"Run this from the project folder the image is built from. {example}")
    try:
        relative = path.relative_to(project.resolve()).as_posix()
    except ValueError:
        raise SkyliftConfigError(f"script {script!r} is outside the project {project}, so the image cannot contain it",
                                 hint="Run this from the folder that holds the script (the image's /app).") from None
    return ("python", relative, *rest)


def torchrun_arguments(topology: Topology, entry: list[str], *, module: bool) -> list[str]:
    """torchrun's argv for ``entry`` (a module and its args when ``module``, else a script)."""
    port = topology.master_port or _free_port()
    if topology.elastic is not None:
        from skylift.launch.elastic import elastic_torchrun_arguments

        return elastic_torchrun_arguments(topology, entry, module=module, port=port)
    argv = [
        f"--nproc-per-node={topology.nproc}",
        f"--nnodes={topology.nnodes}",
        f"--node-rank={topology.node_rank}",
        f"--master-addr={topology.master_addr}",
        f"--master-port={port}",
        "--max-restarts=0",
        f"--shutdown-timeout={max(1, round(topology.resolved_grace_s()))}",
        # SIGUSR1 too: SLURM and some schedulers warn with it before the kill.
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    ]
    if module:
        argv.append("-m")
    return argv + entry


def launch_workers(topology: Topology, entry: list[str], *, module: bool, facts: Facts | None = None,
                   preloaded: bool = False) -> int:
    """Run ``entry`` on ``topology.nproc`` local workers; return the job's exit code.

    ``preloaded``: ``entry`` is one of skylift's own modules whose ``main(argv)`` returns an
    exit code, and the workers are forks of one process that has imported it and torch
    (:mod:`skylift.launch.preloaded_workers`), not a Python start each.

    A failed worker's own exit code is returned (not torchrun's generic 1), so codes
    such as "requeue" (143) reach the caller's scheduler. SIGTERM to this process is
    forwarded to the workers, which get ``grace_s`` to save before SIGKILL. With the
    doctor's ``facts``, the NCCL variables this machine needs are set for the workers
    (never over the user's) and recorded in ``SKYLIFT_NCCL_SETTINGS``.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from skylift.errors import EXIT_REQUEUE

    # torchrun would force 1 thread per worker with a warning; share the cores instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // topology.nproc)))
    interface = _loopback_interface() if _is_loopback(topology.master_addr) else None
    if interface:
        # A rendezvous on loopback means one machine; gloo would otherwise bind the
        # address the host name resolves to, which may be a network card's.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    if facts is not None:
        _apply_nccl_settings(facts, topology)
    if preloaded:
        from skylift.launch.preloaded_workers import start_server

        start_server(entry[0])
    if topology.elastic is not None:
        from skylift.launch.elastic import launch_elastic

        return launch_elastic(topology, entry, module=module, port=topology.master_port or _free_port(),
                              preloaded=preloaded)
    args = get_args_parser().parse_args(torchrun_arguments(topology, entry, module=module))
    try:
        if preloaded:
            _run_preloaded(args, entry)
        else:
            run(args)
    except SignalException as error:
        # torchrun forwarded the signal and gave the workers the grace period to save.
        print(f"skylift: {error.sigval.name} received; workers stopped; exit {EXIT_REQUEUE} (requeue)", file=sys.stderr)
        return EXIT_REQUEUE
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        if code == EXIT_REQUEUE:
            print(f"skylift: workers stopped for preemption; exit {code} (requeue to resume)", file=sys.stderr)
        else:
            print(f"skylift: {len(error.failures)} worker(s) failed, first rank {rank}; exit code {code}",
                  file=sys.stderr)
        return code
    return 0


def _run_preloaded(args: Any, entry: list[str]) -> None:
    """torchrun's own ``run(args)`` with the worker as a function: ``elastic_launch`` with
    the config torchrun builds from the same arguments, on the preloaded fork server."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from skylift.launch.preloaded_workers import PreloadedWorker

    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    elastic_launch(config=config, entrypoint=PreloadedWorker(entry[0]))(*entry[1:])


def _apply_nccl_settings(facts: Facts, topology: Topology) -> None:
    """Put the doctor's NCCL plan into this process's environment, which torchrun's workers inherit."""
    from skylift.machine.nccl import plan_nccl

    plan = plan_nccl(facts, world_size=topology.world_size, nnodes=topology.nnodes, master_addr=topology.master_addr)
    for line in plan.lines():
        print(f"skylift: NCCL: {line}", file=sys.stderr)
    os.environ.update(plan.environment())


def _is_loopback(address: str) -> bool:
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        return False


def _loopback_interface() -> str | None:
    """``lo`` on Linux, ``lo0`` on macOS; ``None`` if neither exists."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((name for name in ("lo", "lo0") if name in names), None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])

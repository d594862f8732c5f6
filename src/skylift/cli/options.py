"""Flags shared by several commands. Imports nothing heavy."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skylift.config.distributed import ElasticNodes
    from skylift.launch.launcher import Topology

__all__ = ["add_config_arguments", "add_topology_arguments", "topology_from"]


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (see examples/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one field, typed like the YAML (repeatable), e.g. --set optim.lr=0.001",
    )


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("processes (PyTorch's torchrun underneath)")
    group.add_argument("--nproc", type=int, default=None, help="worker processes on this node (default 1)")
    group.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="nodes in the job (default 1); MIN:MAX: elastic, continue on MIN to MAX nodes "
                       "(torchrun's c10d rendezvous on --master-addr; node 0 hosts it)")
    group.add_argument("--node-rank", type=int, default=None, help="this node's index, 0..nnodes-1")
    group.add_argument("--master-addr", default=None, help="address of node 0, reachable from all nodes")
    group.add_argument("--master-port", type=int, default=None, help="port on node 0 (default: a free one)")
    group.add_argument("--one-machine", action="store_true",
                       help="rehearse a multi-node or elastic job on this machine: every node is a command here, "
                       "--master-addr a loopback address (refused with --nnodes > 1 otherwise)")
    group.add_argument(
        "--grace-s",
        type=float,
        default=None,
        help="seconds workers get to checkpoint after SIGTERM before they are killed "
        "(default: the detected cloud's notice window; 30 off-cloud)",
    )


def topology_from(args: argparse.Namespace, grace_s: float | None = None,
                  nodes: ElasticNodes | None = None) -> Topology:
    """The Topology from the flags and the platform; ``nodes``: the config's
    ``distributed.nodes`` (an ElasticNodes or None), checked against ``--nnodes``."""
    from skylift.launch.elastic import resolve_nodes
    from skylift.launch.launcher import Topology
    from skylift.submit.environment import TopologyFlags, detect_platform_topology, fill_from_platform

    flag = args.nnodes if isinstance(args.nnodes, str) or args.nnodes is None else str(args.nnodes)
    platform = detect_platform_topology()
    if flag is None and nodes is None and platform is not None and platform.elastic_nodes is not None:
        flag = "{}:{}".format(*platform.elastic_nodes)  # an elastic PyTorchJob's PET_NNODES=MIN:MAX
    elastic = resolve_nodes(flag, nodes)
    given = TopologyFlags(nproc=args.nproc, nnodes=elastic.max if elastic is not None else (None if flag is None
                          else int(flag)), node_rank=args.node_rank, master_addr=args.master_addr,
                          master_port=args.master_port)  # fmt: skip

    # Unset flags (None) take what the platform tells this node (each platform module's
    # detect_topology), else their defaults; a given flag wins.
    filled, platform_grace_s = fill_from_platform(given)
    _check_port_and_grace(filled.master_port, args.grace_s)
    grace_s = next((value for value in (args.grace_s, grace_s, platform_grace_s) if value is not None), None)
    # An elastic pod the platform gave no node rank (PyTorchJob's elasticPolicy) cannot say
    # whether it hosts the rendezvous: torch then decides by host name (the endpoint's pod).
    by_hostname = elastic is not None and platform is not None and platform.node_rank_unknown
    topology = Topology(filled.nproc, filled.nnodes, filled.node_rank, filled.master_addr, filled.master_port, grace_s,
                        elastic, rendezvous_host_by_name=by_hostname, one_machine=args.one_machine)
    topology.validate()
    return topology


def _check_port_and_grace(master_port: int | None, grace_s: float | None) -> None:
    """Refused here, before any dry run passes them: torchrun would fail on the port with a
    traceback, and a negative grace would kill workers before they could save."""
    import math

    from skylift.errors import SkyliftConfigError

    if master_port is not None and not 1 <= master_port <= 65535:
        raise SkyliftConfigError(
            f"--master-port must be a TCP port, 1 to 65535, got {master_port}",
            hint="Leave it out to take a free port (one node), or pass the same port on every node.",
        )
    if grace_s is not None and not (math.isfinite(grace_s) and grace_s >= 0):
        raise SkyliftConfigError(f"--grace-s must be a number of seconds >= 0, got {grace_s}",
                                 hint="Leave it out for the detected cloud's notice window (30 s off-cloud).")

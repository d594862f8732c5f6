"""Flags shared by several commands. Imports nothing heavy."""

from __future__ import annotations

import argparse

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
    group.add_argument("--nproc", type=int, default=1, help="worker processes on this node (default 1)")
    group.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    group.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1")
    group.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, reachable from all nodes")
    group.add_argument("--master-port", type=int, default=None, help="port on node 0 (default: a free one)")
    group.add_argument(
        "--grace-s",
        type=float,
        default=None,
        help="seconds workers get to checkpoint after SIGTERM before they are killed "
        "(default: the detected cloud's notice window; 30 off-cloud)",
    )


def topology_from(args: argparse.Namespace, grace_s: float | None = None):  # noqa: ANN201 - Topology
    from skylift.train.launcher import Topology

    grace_s = args.grace_s if args.grace_s is not None else grace_s
    topology = Topology(args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port, grace_s)
    topology.validate()
    return topology

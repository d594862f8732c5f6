"""Inside a submitted job: how each platform tells a node its rank and the master.

``skylift run`` calls :func:`fill_from_platform` before it builds torchrun's topology,
so the same command starts the right multi-node job on every platform with no flag:

* SageMaker writes ``/opt/ml/input/config/resourceconfig.json`` (``hosts``,
  ``current_host``); a custom image gets no ``SM_*`` variables. Rank is the host's
  index in ``hosts``, the master ``hosts[0]``; port ``MASTER_PORT`` if set, else 7777
  as the SageMaker training toolkit uses; one process per visible GPU.
* PAI-DLC and TI-ONE set ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (nodes) and
  ``RANK`` (node index), plus ``NPROC_PER_NODE`` (DLC) or ``GPU_NUM_PER_NODE`` (TI-ONE).
* Kubeflow Trainer (and the v1 PyTorchJob) set ``PET_NNODES``, ``PET_NODE_RANK``,
  ``PET_NPROC_PER_NODE`` and ``PET_MASTER_ADDR``/``PET_MASTER_PORT`` (v1: ``MASTER_*``).
  An elastic v1 PyTorchJob sets ``PET_NNODES=MIN:MAX`` and ``PET_RDZV_ENDPOINT`` instead
  of a master and a rank: the topology is then ``nnodes`` MAX, node 0, the endpoint as
  the master, and ``elastic_nodes`` (MIN, MAX).
* SkyPilot sets ``SKYPILOT_NODE_IPS`` (head first), ``SKYPILOT_NODE_RANK``,
  ``SKYPILOT_NUM_NODES`` and ``SKYPILOT_NUM_GPUS_PER_NODE``; port ``MASTER_PORT`` if
  set, else 29500.

A flag given on the command line wins over the platform's value, and the difference
is reported. Inside a torchrun worker (``LOCAL_RANK`` set) nothing is detected.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from skylift.errors import SkyliftConfigError

__all__ = ["SAGEMAKER_RESOURCE_CONFIG", "PlatformTopology", "detect_platform_topology", "fill_from_platform"]

SAGEMAKER_RESOURCE_CONFIG = Path("/opt/ml/input/config/resourceconfig.json")
SAGEMAKER_MASTER_PORT = 7777
SKYPILOT_MASTER_PORT = 29500
# SageMaker kills the container 120 s after SIGTERM; keep 10 s for torchrun to exit.
SAGEMAKER_GRACE_S = 110.0
# Defaults of the topology flags when neither a flag nor the platform gives a value.
_DEFAULTS = {"nproc": 1, "nnodes": 1, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": None}
_FLAGS = {"nproc": "--nproc", "nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
          "master_port": "--master-port"}


@dataclass(frozen=True)
class PlatformTopology:
    platform: str
    source: str
    """What it was read from, for the report."""
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    nproc: int | None = None
    """``None``: one process per visible GPU (at least one)."""
    grace_s: float | None = None
    node_level_variables: tuple[str, ...] = ()
    """Variables the platform sets per node that torchrun's workers read per process
    (``RANK``, ``WORLD_SIZE``): removed before the workers start."""
    elastic_nodes: tuple[int, int] | None = None
    """(MIN, MAX) when the platform runs an elastic job (``PET_NNODES=MIN:MAX``)."""
    node_rank_unknown: bool = False
    """The platform gave no node rank (an elastic PyTorchJob numbers nodes at rendezvous)."""


def detect_platform_topology(environ: Mapping[str, str] | None = None,
                             sagemaker_config: Path | None = None) -> PlatformTopology | None:
    """The topology the platform this process runs on announces, or ``None``."""
    environ = os.environ if environ is None else environ
    if "LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ:
        return None  # a torchrun worker: the agent already did this
    for detect in (_kubeflow, _skypilot, _tione, _pai):
        found = detect(environ)
        if found is not None:
            return found
    return _sagemaker(sagemaker_config or SAGEMAKER_RESOURCE_CONFIG, environ)


def fill_from_platform(args: argparse.Namespace, environ: dict[str, str] | None = None) -> float | None:
    """Set each topology flag left unset (``None``) from the platform, else its default.

    Returns the platform's grace period (``None`` if it has none). Reports what was
    detected, and every flag that overrides the platform, on stderr.
    """
    environ = os.environ if environ is None else environ
    found = detect_platform_topology(environ)
    detected = {}
    if found is not None:
        detected = {"nproc": found.nproc or _visible_gpus(), "nnodes": found.nnodes, "node_rank": found.node_rank,
                    "master_addr": found.master_addr, "master_port": found.master_port}
        elastic = f" (elastic {found.elastic_nodes[0]}:{found.elastic_nodes[1]})" if found.elastic_nodes else ""
        print(f"skylift: {found.platform} job ({found.source}): node {found.node_rank} of {found.nnodes}{elastic}, "
              f"{detected['nproc']} process(es) per node, master {found.master_addr}:{found.master_port}",
              file=sys.stderr)
        for name in found.node_level_variables:
            environ.pop(name, None)
    for name, default in _DEFAULTS.items():
        given = getattr(args, name, None)
        if given is None:
            setattr(args, name, detected.get(name, default))
        elif name in detected and detected[name] != given:
            print(f"skylift: {_FLAGS[name]} {given} overrides {found.platform}'s {detected[name]}", file=sys.stderr)
    return found.grace_s if found is not None else None


def _integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise SkyliftConfigError(f"the platform set {name}={environ[name]!r}, which is not a whole number") from None


def _optional_integer(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    return int(value) if value.isdigit() else None


def _kubeflow(environ: Mapping[str, str]) -> PlatformTopology | None:
    if "PET_NNODES" not in environ:
        return None
    address = environ.get("PET_MASTER_ADDR") or environ.get("MASTER_ADDR") or "127.0.0.1"
    port = _optional_integer(environ, "PET_MASTER_PORT") or _optional_integer(environ, "MASTER_PORT")
    elastic = _node_range(environ["PET_NNODES"]) if ":" in environ["PET_NNODES"] else None
    if elastic is not None and environ.get("PET_RDZV_ENDPOINT"):
        address, _, endpoint_port = environ["PET_RDZV_ENDPOINT"].rpartition(":")
        port = _integer({"PET_RDZV_ENDPOINT": endpoint_port}, "PET_RDZV_ENDPOINT")
    nnodes = elastic[1] if elastic else _integer(environ, "PET_NNODES")
    # "auto", "gpu" or "cpu" leave the count to the visible devices.
    return PlatformTopology("Kubeflow", "PET_* variables", nnodes,
                            _optional_integer(environ, "PET_NODE_RANK") or 0, address, port,
                            _optional_integer(environ, "PET_NPROC_PER_NODE"),
                            node_level_variables=("RANK", "WORLD_SIZE"), elastic_nodes=elastic,
                            node_rank_unknown=elastic is not None and "PET_NODE_RANK" not in environ)


def _node_range(value: str) -> tuple[int, int]:
    low, _, high = value.partition(":")
    if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
        raise SkyliftConfigError(f"the platform set PET_NNODES={value!r}, which is neither a whole number nor MIN:MAX")
    return int(low), int(high)


def _skypilot(environ: Mapping[str, str]) -> PlatformTopology | None:
    if "SKYPILOT_NUM_NODES" not in environ:
        return None
    nnodes = _integer(environ, "SKYPILOT_NUM_NODES")
    ips = environ.get("SKYPILOT_NODE_IPS", "").split()
    address = ips[0] if ips and nnodes > 1 else "127.0.0.1"
    port = _optional_integer(environ, "MASTER_PORT") or SKYPILOT_MASTER_PORT
    return PlatformTopology("SkyPilot", "SKYPILOT_* variables", nnodes, _integer(environ, "SKYPILOT_NODE_RANK"),
                            address, port if nnodes > 1 else None,
                            _optional_integer(environ, "SKYPILOT_NUM_GPUS_PER_NODE") or None)


def _node_level(environ: Mapping[str, str], platform: str, gpus_variable: str) -> PlatformTopology:
    return PlatformTopology(platform, f"MASTER_ADDR, WORLD_SIZE, RANK, {gpus_variable}",
                            _integer(environ, "WORLD_SIZE"), _integer(environ, "RANK"), environ["MASTER_ADDR"],
                            _optional_integer(environ, "MASTER_PORT"),
                            _optional_integer(environ, gpus_variable) or None,
                            node_level_variables=("RANK", "WORLD_SIZE"))


def _has_node_level(environ: Mapping[str, str]) -> bool:
    return all(name in environ for name in ("MASTER_ADDR", "WORLD_SIZE", "RANK"))


def _tione(environ: Mapping[str, str]) -> PlatformTopology | None:
    marked = environ.get("SKYLIFT_PLATFORM") == "tione" or "GPU_NUM_PER_NODE" in environ or "NODE_LIST" in environ
    if not _has_node_level(environ) or not marked:
        return None
    return _node_level(environ, "TI-ONE", "GPU_NUM_PER_NODE")


def _pai(environ: Mapping[str, str]) -> PlatformTopology | None:
    # DLC's contract; also any launcher that exports node-level RANK/WORLD_SIZE.
    if not _has_node_level(environ) or ("NPROC_PER_NODE" not in environ and environ.get("SKYLIFT_PLATFORM") != "pai"):
        return None
    return _node_level(environ, "PAI-DLC", "NPROC_PER_NODE")


def _sagemaker(path: Path, environ: Mapping[str, str]) -> PlatformTopology | None:
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
        hosts, current = sorted(config["hosts"]), config["current_host"]
        rank = hosts.index(current)
    except (OSError, ValueError, KeyError) as error:
        raise SkyliftConfigError(
            f"{path} is not a SageMaker resource config with hosts and current_host: {error}") from None
    nnodes = len(hosts)
    port = _optional_integer(environ, "MASTER_PORT") or SAGEMAKER_MASTER_PORT
    return PlatformTopology("SageMaker", str(path), nnodes, rank, hosts[0] if nnodes > 1 else "127.0.0.1",
                            port if nnodes > 1 else None, grace_s=SAGEMAKER_GRACE_S)


def _visible_gpus() -> int:
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1

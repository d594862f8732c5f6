"""Inside a submitted job: how the platform tells a node its rank and the master.

``skylift run`` calls :func:`fill_from_platform` before it builds torchrun's topology,
so the same command starts the right multi-node job on every platform with no flag.
Each platform module reads its own contract (``Platform.detect_topology``: SageMaker's
``resourceconfig.json``, PAI-DLC's and TI-ONE's ``MASTER_ADDR``/``RANK``, Kubeflow's
``PET_*``, SkyPilot's ``SKYPILOT_*``); the helpers they share are here.

A flag given on the command line wins over the platform's value, and the difference
is reported. Inside a torchrun worker (``LOCAL_RANK`` set) nothing is detected.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from skylift.errors import SkyliftConfigError
from skylift.submit.base import PlatformTopology, platforms

__all__ = [
    "FILESYSTEM_ROOT",
    "FilledTopology",
    "PlatformTopology",
    "TopologyFlags",
    "detect_platform_topology",
    "fill_from_platform",
    "has_node_level",
    "integer",
    "node_level",
    "optional_integer",
]

FILESYSTEM_ROOT = Path("/")
"""Where a platform's files (SageMaker's resource config) are looked for; tests move it."""


@dataclass(frozen=True)
class TopologyFlags:
    """``skylift run``'s topology flags; ``None``: not given."""

    nproc: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None


@dataclass(frozen=True)
class FilledTopology:
    """The topology flags once each unset one took the platform's value or its default."""

    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    """``None``: torchrun's default port."""


# Defaults of the topology flags when neither a flag nor the platform gives a value.
_DEFAULTS = TopologyFlags(nproc=1, nnodes=1, node_rank=0, master_addr="127.0.0.1", master_port=None)
_FLAGS = {"nproc": "--nproc", "nnodes": "--nnodes", "node_rank": "--node-rank", "master_addr": "--master-addr",
          "master_port": "--master-port"}


def detect_platform_topology(environ: Mapping[str, str] | None = None,
                             filesystem_root: Path | None = None) -> PlatformTopology | None:
    """The topology the platform this process runs on announces, or ``None``."""
    environ = os.environ if environ is None else environ
    if "LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ:
        return None  # a torchrun worker: the agent already did this
    root = FILESYSTEM_ROOT if filesystem_root is None else filesystem_root
    for platform in sorted(platforms(), key=lambda platform: platform.detect_order):
        found = platform.detect_topology(environ, root)
        if found is not None:
            return found
    return None


def fill_from_platform(flags: TopologyFlags,
                       environ: MutableMapping[str, str] | None = None) -> tuple[FilledTopology, float | None]:
    """Each flag left unset (``None``) from the platform, else its default; and the
    platform's grace period (``None`` if it has none).

    Reports what was detected, and every flag that overrides the platform, on stderr, and
    removes the platform's node-level variables (``RANK``) from ``environ``.
    """
    environ = os.environ if environ is None else environ
    found = detect_platform_topology(environ)
    detected: dict[str, object] = {}
    if found is not None:
        detected = {"nproc": found.nproc or _visible_gpus(), "nnodes": found.nnodes, "node_rank": found.node_rank,
                    "master_addr": found.master_addr, "master_port": found.master_port}
        elastic = f" (elastic {found.elastic_nodes[0]}:{found.elastic_nodes[1]})" if found.elastic_nodes else ""
        print(f"skylift: {found.platform} job ({found.source}): node {found.node_rank} of {found.nnodes}{elastic}, "
              f"{detected['nproc']} process(es) per node, master {found.master_addr}:{found.master_port}",
              file=sys.stderr)
        for name in found.node_level_variables:
            environ.pop(name, None)
    filled: dict[str, Any] = {}
    for field in fields(TopologyFlags):
        name = field.name
        given = getattr(flags, name)
        if given is None:
            given = detected.get(name, getattr(_DEFAULTS, name))
        elif found is not None and name in detected and detected[name] != given:
            print(f"skylift: {_FLAGS[name]} {given} overrides {found.platform}'s {detected[name]}", file=sys.stderr)
        filled[name] = given
    return FilledTopology(**filled), (found.grace_s if found is not None else None)


def integer(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise SkyliftConfigError(f"the platform set {name}={environ[name]!r}, which is not a whole number") from None


def optional_integer(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    return int(value) if value.isdigit() else None


def node_level(environ: Mapping[str, str], platform: str, gpus_variable: str) -> PlatformTopology:
    """A platform that sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (nodes), ``RANK``
    (node index) and ``gpus_variable`` (processes per node): PAI-DLC, TI-ONE."""
    return PlatformTopology(platform, f"MASTER_ADDR, WORLD_SIZE, RANK, {gpus_variable}",
                            integer(environ, "WORLD_SIZE"), integer(environ, "RANK"), environ["MASTER_ADDR"],
                            optional_integer(environ, "MASTER_PORT"),
                            optional_integer(environ, gpus_variable) or None,
                            node_level_variables=("RANK", "WORLD_SIZE"))


def has_node_level(environ: Mapping[str, str]) -> bool:
    return all(name in environ for name in ("MASTER_ADDR", "WORLD_SIZE", "RANK"))


def _visible_gpus() -> int:
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1

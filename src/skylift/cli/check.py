"""``skylift check CONFIG``: validate and print the resolved config (secrets redacted).

It runs the checks ``skylift run`` makes of the job before its first worker (the same
``check_job`` as ``skylift run`` and its ``--dry-run``: store URLs, a local dataset's index,
the recipe's arguments, the batch for the job's shape, FSDP's options, the exporters'
packages, the flags' port and grace), so a config it passes does not then fail at the
start of the run for those. This machine's devices (device: cuda, nccl without GPUs) and
the doctor's checks are ``run --dry-run``'s: check imports no torch, and answers at once.
Nothing is started or written.
"""

from __future__ import annotations

import argparse
import json

from skylift.cli.options import add_config_arguments, add_topology_arguments, topology_from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    add_topology_arguments(parser)  # the job's shape, checked as the run would (--nproc, --master-port, ...)
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")


def execute(args: argparse.Namespace) -> int:
    import yaml

    from skylift.cloud.redact import redact_config
    from skylift.config.load import load_config
    from skylift.launch.preflight import check_job

    config = load_config(args.config, args.overrides)
    topology = topology_from(args, grace_s=config.preemption.grace_s, nodes=config.distributed.nodes)
    check_job(config, topology.world_size)
    # Every field, but no secret in clear: submit.envs values and URLs' user-info are redacted.
    resolved = redact_config(config.model_dump(mode="json"))
    print(json.dumps(resolved, indent=2) if args.json else yaml.safe_dump(resolved, sort_keys=False), end="")
    return 0

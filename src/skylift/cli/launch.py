"""``skylift launch [flags] -- python script.py args``: any torchrun-style script.

The script runs unmodified under torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). skylift adds a clean shutdown after it
returns, which avoids gloo's intermittent abort at interpreter exit.
"""

from __future__ import annotations

import argparse
import os
import sys

from skylift.cli.options import add_topology_arguments, topology_from

_PYTHON_NAMES = {"python", "python3", os.path.basename(sys.executable)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_topology_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command; start nothing")
    parser.add_argument("--no-doctor", action="store_true", help="start without the doctor's job checks")
    parser.add_argument(
        "script_command",
        nargs=argparse.REMAINDER,
        metavar="-- SCRIPT [ARGS ...]",
        help="after --: the script and its arguments, e.g. -- python train.py --epochs 3 (or -- -m pkg.module)",
    )


def execute(args: argparse.Namespace) -> int:
    from skylift.errors import SkyliftConfigError
    from skylift.train.launcher import launch_workers, torchrun_arguments

    command = _script_command(args.script_command)
    if not command:
        raise SkyliftConfigError(
            "no script given", hint="Example: skylift launch --nproc 2 -- python train.py --epochs 3"
        )
    if command[0] != "-m" and not os.path.isfile(command[0]):
        raise SkyliftConfigError(f"script {command[0]!r} does not exist", hint="Check the path after --.")
    topology = topology_from(args)
    entry = ["skylift.cli.shim", *command]
    if args.dry_run:
        print("torchrun " + " ".join(torchrun_arguments(topology, entry, module=True)))
        return 0
    from skylift.doctor.gate import check_before_start

    facts = check_before_start(None, command="launch", nproc=topology.nproc, nnodes=topology.nnodes,
                               enforce=not args.no_doctor)  # fmt: skip
    return launch_workers(topology, entry, module=True, facts=facts)


def _script_command(command: list[str]) -> list[str]:
    if command and command[0] == "--":
        command = command[1:]
    if command and os.path.basename(command[0]) in _PYTHON_NAMES:
        command = command[1:]
    return command

"""``skylift launch [flags] -- python script.py args``: any torchrun-style script.

The script runs unmodified under torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT). On a platform (SageMaker, PAI-DLC, TI-ONE,
Kubeflow, SkyPilot) the topology comes from what it tells the node, as for ``skylift
run``. ``--checkpoint-root`` and ``--run-dir`` reach the script as ``SKYLIFT_CHECKPOINT_ROOT``
and ``SKYLIFT_RUN_DIR`` (:mod:`skylift.config.script_environment`), which skylift's
Runtime and integrations read. skylift adds a clean shutdown after the script returns,
which avoids gloo's intermittent abort at interpreter exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from skylift.cli.options import add_topology_arguments, topology_from
from skylift.integrations.attach import ATTACH_VARIABLE, with_startup_path
from skylift.loop.lifeline import LAUNCHER_PID_VARIABLE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_topology_arguments(parser)
    group = parser.add_argument_group("what the script reads (skylift's Runtime and integrations)")
    group.add_argument("--checkpoint-root", default=None, metavar="PATH|URL",
                       help="where checkpoints go (a folder, s3://, oss://, cos://): sets SKYLIFT_CHECKPOINT_ROOT")
    group.add_argument("--run-dir", default=None, metavar="PATH",
                       help="the run folder (metrics, report, final model): sets SKYLIFT_RUN_DIR")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun command; start nothing")
    parser.add_argument("--no-doctor", action="store_true", help="start without the doctor's job checks")
    parser.add_argument("--no-attach", action="store_true",
                        help="leave the program's Trainers alone: no SkyliftCallback, no automatic resume "
                        "(sets SKYLIFT_ATTACH=0)")
    parser.add_argument(
        "script_command",
        nargs=argparse.REMAINDER,
        metavar="-- SCRIPT [ARGS ...]",
        help="after --: the program and its arguments, e.g. -- python train.py --epochs 3, -- -m pkg.module, "
        "or a Python console script on the PATH: -- trl sft --config sft.yaml",
    )


def execute(args: argparse.Namespace) -> int:
    from skylift.errors import SkyliftConfigError
    from skylift.launch.launcher import launch_workers, script_arguments, torchrun_arguments

    command = script_arguments(args.script_command)
    if not command:
        raise SkyliftConfigError(
            "no script given", hint="Example: skylift launch --nproc 2 -- python train.py --epochs 3"
        )
    if command[0] != "-m" and not os.path.isfile(command[0]):
        command = [console_script(command[0]), *command[1:]]
    topology = topology_from(args)
    entry = ["skylift.cli.shim", *command]
    told = _script_environment(args)
    if args.no_attach:
        told[ATTACH_VARIABLE] = "0"
    # The hook reaches the workers' Python children too (trl sft re-launches through accelerate).
    told["PYTHONPATH"] = with_startup_path(os.environ.get("PYTHONPATH"))
    if args.dry_run:
        for name, value in told.items():
            print(f"{name}={value}")
        print("torchrun " + " ".join(torchrun_arguments(topology, entry, module=True)))
        return 0
    os.environ.update(told)  # torchrun's workers inherit this process's environment
    _say_script_environment()
    from skylift.doctor.gate import check_before_start

    facts = check_before_start(None, command="launch", nproc=topology.nproc, nnodes=topology.nnodes,
                               enforce=not args.no_doctor)  # fmt: skip
    from skylift.launch.notice_relay import NoticeRelay

    lease = _take_lease() if _holds_the_lease(topology) else None
    relay = NoticeRelay()
    # The workers die with this process (a kill -9 of it leaves none training) and read the relayed notice.
    os.environ.update({LAUNCHER_PID_VARIABLE: str(os.getpid()), **relay.environment()})
    relay.start()
    try:
        code = launch_workers(topology, entry, module=True, facts=facts)
    finally:
        relay.stop()
        if lease is not None:
            lease.release()
    return _after_a_notice(code, relay)


def _holds_the_lease(topology: Any) -> bool:
    """Whether this launcher takes the job's lease: one launcher per job does. Each node of
    a multi-node job runs its own, so node 0's takes it for a fixed-size job (global rank
    0 is on it); an elastic job's nodes get their ranks only at the rendezvous, so there a
    skylift Runtime's rank 0 takes it, wherever it lands."""
    if (topology.nnodes or 1) == 1:
        return True
    return topology.elastic is None and (topology.node_rank or 0) == 0


def _take_lease() -> Any:
    """The checkpoint root's run lease, for whatever the workers run (None without a root).

    Taken by one launcher per job (:func:`_holds_the_lease`): one lease per launcher would
    refuse the job's other nodes."""
    from skylift.config.script_environment import ScriptEnvironment
    from skylift.launch.run_lease import take_launch_lease

    root = ScriptEnvironment.read().checkpoint_root
    if not root:
        return None
    lease, variables = take_launch_lease(root)
    os.environ.update(variables)
    return lease


def console_script(name: str) -> str:
    """The file of a Python console script on the PATH (``trl``, ``axolotl``,
    ``llamafactory-cli``): the workers run it as ``python FILE`` would.

    Raises:
        SkyliftConfigError: no such file or command, or a command that is not a Python script.
    """
    import shutil
    import sysconfig

    from skylift.errors import SkyliftConfigError

    # This interpreter's own scripts folder too: `.venv/bin/python -m skylift` runs without the venv on the PATH.
    found = shutil.which(name) or shutil.which(name, path=sysconfig.get_path("scripts"))
    if found is None:
        raise SkyliftConfigError(f"{name!r} is neither a script nor a command on the PATH",
                                 hint="Check the path after --, or install the program into this environment.")
    with open(found, "rb") as handle:
        first_line = handle.readline(200)
    if not (first_line.startswith(b"#!") and b"python" in first_line):
        raise SkyliftConfigError(f"{name!r} ({found}) is not a Python console script, so skylift cannot run it "
                                 "in its workers", hint="Give the Python script after --: -- python train.py ...")
    return found


def _after_a_notice(code: int, relay: Any) -> int:
    """After a relayed notice the machine is going away: a worker that saved and ended
    (0), or was ended by the signal, means "run again", 143; another code stays."""
    from skylift.errors import EXIT_REQUEUE

    if getattr(relay, "relayed", None) is None or code == EXIT_REQUEUE:
        return code
    if code in (0, 1, 128 + 15, 128 + 9):  # torchrun reports a worker ended by a signal as 1
        print(f"skylift: the workers stopped for the cloud's notice; exit {EXIT_REQUEUE} (requeue to resume)",
              file=sys.stderr)
        return EXIT_REQUEUE
    return code


def _script_environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables the flags set; a flag wins over the same variable already set."""
    from skylift.config.script_environment import ScriptEnvironment

    return ScriptEnvironment(run_dir=args.run_dir, checkpoint_root=args.checkpoint_root).as_environment()


def _say_script_environment() -> None:
    """Every variable the script will read, flags' and platform's alike: where a job's
    checkpoints went is the first question after a restart."""
    from skylift.config.script_environment import ScriptEnvironment

    told = ScriptEnvironment.read().as_environment()
    if told:
        print("skylift: the script reads " + ", ".join(f"{name}={value}" for name, value in told.items()),
              file=sys.stderr)

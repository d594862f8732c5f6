"""``skylift submit CONFIG --platform P``: build the platform's job request and send it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from skylift.cli.options import add_config_arguments
from skylift.submit.base import MODULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--platform", required=True, choices=list(MODULES), help="where the job runs")
    parser.add_argument("--instance", default=None, metavar="TYPE",
                        help="machine per node in the platform's names, e.g. ml.p4d.24xlarge, A100:8")
    parser.add_argument("--count", type=int, default=None, metavar="N", help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                        help="GPUs per node (Kubernetes needs it; others read it on the node)")
    parser.add_argument("--spot", action="store_true", default=None, help="spot capacity; the job resumes")
    parser.add_argument("--image", default=None, metavar="URI", help="image with skylift (skylift dockerfile)")
    parser.add_argument("--region", default=None, help="cloud region (default: the vendor's configured one)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the exact request (secrets redacted); send nothing")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--watch", action="store_true",
                        help="follow the job; resubmit it after a spot reclaim the platform does not relaunch "
                             "(later, from another terminal: skylift jobs watch JOB)")
    parser.add_argument("--max-resubmits", type=int, default=None, metavar="N",
                        help="--watch: resubmissions after reclaims (default submit.max_resubmits, 3)")


def execute(args: argparse.Namespace) -> int:
    from skylift.submit.output import exit_code

    return exit_code("submit", lambda: _submit(args))


def _submit(args: argparse.Namespace) -> int:
    from skylift.submit.base import platform_module
    from skylift.submit.output import print_request, print_submitted
    from skylift.submit.spec import job_from_inputs

    flags = {"image": args.image, "instance_type": args.instance, "instance_count": args.count,
             "gpus_per_node": args.gpus_per_node, "spot": args.spot, "region": args.region,
             "max_resubmits": args.max_resubmits}
    job = job_from_inputs(args.config, args.overrides, flags, platform=args.platform, command=_command(args))
    platform = platform_module(args.platform)
    request = platform.build(job)
    if args.dry_run:
        print_request(request, as_json=args.json)
        return 0
    ref = platform.send(request, job.options)
    from skylift.submit import records

    record = records.new_record(job, ref, config_path=args.config, overrides=args.overrides, flags=flags)
    saved = _save(record, ref)
    print_submitted(request, ref, as_json=args.json, record=saved)
    if not args.watch:
        return 0
    from skylift.submit.watch import watch

    return watch(platform, job, ref, record=record if saved else None)


def _command(args: argparse.Namespace) -> list[str]:
    """The ``skylift submit`` command as given (flags in a fixed order), for the error
    that names the one command that would pass."""
    command = ["skylift", "submit", args.config, "--platform", args.platform]
    for flag, value in (("--instance", args.instance), ("--count", args.count),
                        ("--gpus-per-node", args.gpus_per_node), ("--image", args.image), ("--region", args.region),
                        ("--max-resubmits", args.max_resubmits)):
        if value is not None:
            command += [flag, str(value)]
    for override in args.overrides:
        command += ["--set", _without_secret(override)]
    switches = (("--spot", args.spot), ("--dry-run", args.dry_run), ("--json", args.json), ("--watch", args.watch))
    return command + [flag for flag, given in switches if given]


def _without_secret(override: str) -> str:
    """``--set KEY=VALUE`` as an error may print it: a secret-looking key's value is left
    for the user to fill in, and a credential of this environment is redacted."""
    from skylift.cloud.redact import is_secret_name, redact

    key, _, _ = override.partition("=")
    return f"{key}=<value>" if is_secret_name(key) else redact(override)


def _save(record, ref) -> Path | None:
    """Write the job's local record for ``skylift jobs watch``; failing costs only that."""
    from skylift.submit import records

    try:
        return records.save(record)
    except OSError as error:
        print(f"skylift submit: could not write the job record under {records.jobs_dir()} ({error}); "
              f"`skylift jobs watch {ref}` will follow it by status only (set {records.JOBS_DIR_VARIABLE} "
              "to a writable folder)", file=sys.stderr)
        return None

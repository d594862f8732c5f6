"""``skylift jobs status|logs|stop JOB``: a job that ``skylift submit`` started.

JOB is the reference ``skylift submit`` printed, ``PLATFORM:LOCATION:ID``.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("status", "logs", "stop"), help="what to do with the job")
    parser.add_argument("job", metavar="JOB", help="PLATFORM:LOCATION:ID as printed by skylift submit")
    parser.add_argument("--endpoint", default=None,
                        help="API endpoint to use instead of the vendor's default (Kubernetes: the kube context)")
    parser.add_argument("--lines", type=int, default=200, help="logs: last lines per node (default 200)")
    parser.add_argument("--json", action="store_true", help="status: machine-readable output")


def execute(args: argparse.Namespace) -> int:
    from skylift.submit.output import exit_code

    return exit_code("jobs", lambda: _act(args))


def _act(args: argparse.Namespace) -> int:
    from skylift.submit.base import JobRef, platform_module
    from skylift.submit.output import print_status
    from skylift.submit.redact import redact

    ref = JobRef.parse(args.job)
    platform = platform_module(ref.platform)
    if args.action == "status":
        print_status(platform.status(ref, args.endpoint), as_json=args.json)
    elif args.action == "logs":
        for line in platform.logs(ref, args.endpoint, max_lines=args.lines):
            print(redact(line))
    else:
        platform.stop(ref, args.endpoint)
        print(f"skylift jobs: asked {ref.platform} to stop {ref}; check with: skylift jobs status {ref}")
    return 0

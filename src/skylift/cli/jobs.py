"""``skylift jobs status|logs|stop|watch JOB``: a job that ``skylift submit`` started.

JOB is the reference ``skylift submit`` printed, ``PLATFORM:LOCATION:ID``. ``watch``
follows it from any terminal, later (after the laptop slept, the window closed): with
the local record ``skylift submit`` wrote, it resubmits the job after a spot reclaim the
platform does not relaunch, counting ``max_resubmits`` on from the record; without one
it follows the status only and says why it cannot resubmit.
"""

from __future__ import annotations

import argparse
import json
import time

from skylift.errors import SkyliftConfigError

_WATCH_ONLY = ("--config", "--set", "--max-resubmits", "--poll-interval-s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("watch follows JOB from any terminal until it ends; with the record skylift submit wrote "
                     "(~/.skylift/jobs, or $SKYLIFT_JOBS_DIR) it also resubmits it after a spot reclaim. "
                     "Example: skylift jobs watch pai:cn-hangzhou:dlc1a2b3c4d")
    parser.add_argument("action", choices=("status", "logs", "stop", "watch"), help="what to do with the job")
    parser.add_argument("job", metavar="JOB", help="PLATFORM:LOCATION:ID as printed by skylift submit")
    parser.add_argument("--endpoint", default=None,
                        help="API endpoint to use instead of the vendor's default (Kubernetes: the kube context)")
    parser.add_argument("--lines", type=int, default=200, help="logs: last lines per node (default 200)")
    parser.add_argument("--json", action="store_true",
                        help="status: machine-readable output; watch: one JSON object per event line")
    watch = parser.add_argument_group("watch")
    watch.add_argument("--config", default=None, metavar="PATH",
                       help="the job's config, where it is now (default: the path its record names)")
    watch.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="added to the recorded --set items (repeatable); gives again a secret one the "
                            "record withheld")
    watch.add_argument("--max-resubmits", type=int, default=None, metavar="N",
                       help="resubmissions in all, those of earlier processes included (default: the job's)")
    watch.add_argument("--poll-interval-s", type=float, default=None, metavar="S",
                       help="seconds between status checks (default: the job's submit.poll_interval_s, 30)")


def execute(args: argparse.Namespace) -> int:
    from skylift.submit.output import exit_code

    return exit_code("jobs", lambda: _act(args))


def _act(args: argparse.Namespace) -> int:
    from skylift.cloud.redact import redact
    from skylift.submit.base import JobRef, platform_module
    from skylift.submit.output import print_status

    ref = JobRef.parse(args.job)
    if args.action == "watch":
        return _watch(ref, args)
    given = [flag for flag, value in zip(_WATCH_ONLY, (args.config, args.overrides, args.max_resubmits,
                                                        args.poll_interval_s), strict=True) if value]
    if given:
        raise SkyliftConfigError(f"{', '.join(given)} only go with watch", hint=f"Run: skylift jobs watch {ref} ...")
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


def _watch(ref, args: argparse.Namespace) -> int:
    from skylift.cloud.redact import redact
    from skylift.submit.watch import reconnect

    if args.max_resubmits is not None and args.max_resubmits < 0:
        raise SkyliftConfigError(f"--max-resubmits is {args.max_resubmits}; give 0 or more")
    if args.poll_interval_s is not None and args.poll_interval_s <= 0:
        raise SkyliftConfigError(f"--poll-interval-s is {args.poll_interval_s}; give a number of seconds above 0")
    def say(line: str) -> None:
        if args.json:  # one object per line, so a machine can follow the watch as it goes
            print(json.dumps({"time": time.time(), "job": str(ref), "message": redact(line)}), flush=True)
        else:
            print(redact(line))

    return reconnect(ref, config_path=args.config, overrides=args.overrides, max_resubmits=args.max_resubmits,
                     poll_interval_s=args.poll_interval_s, endpoint=args.endpoint, say=say)

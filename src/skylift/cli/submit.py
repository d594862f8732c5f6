"""``skylift submit CONFIG --platform P``: build the platform's job request and send it.

A script job, ``skylift submit --platform P [--config RUN.yaml] -- python train.py ARGS``,
sends the script instead (:mod:`skylift.submit.script`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from skylift.errors import SkyliftConfigError

if TYPE_CHECKING:
    from skylift.submit.spec import JobSpec
from skylift.submit.base import platform_names, resolve_platform

_SCRIPT_EXAMPLE = "skylift submit --platform sagemaker ... -- python train.py --epochs 3"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (f"A script job gives the script after --, e.g. {_SCRIPT_EXAMPLE} (or -- -m pkg.module); "
                     "it runs under skylift launch in the image, with --config RUN.yaml (optional) as the config "
                     "submit reads its checkpoint, run_dir, preemption and submit fields from.")
    parser.add_argument("config", nargs="?", default=None,
                        help="YAML config of the run (see examples/); a script job gives its script after -- instead")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one field, typed like the YAML (repeatable), e.g. --set optim.lr=0.001")
    parser.add_argument("--config", dest="script_config", default=None, metavar="RUN.yaml",
                        help="a script job: the config submit reads checkpoint, run_dir, preemption and submit from")
    parser.add_argument("--platform", required=True, type=_platform_name, choices=platform_names(),
                        metavar="{" + ",".join(platform_names(with_aliases=True)) + "}",
                        help="where the job runs (kubernetes is k8s)")
    parser.add_argument("--instance", default=None, metavar="TYPE",
                        help="machine per node in the platform's names, e.g. ml.p4d.24xlarge, A100:8")
    parser.add_argument("--count", type=int, default=None, metavar="N", help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                        help="GPUs per node (Kubernetes needs it; others read it on the node)")
    parser.add_argument("--spot", action="store_true", default=None, help="spot capacity; the job resumes")
    parser.add_argument("--image", default=None, metavar="URI", help="image with skylift (skylift dockerfile)")
    parser.add_argument("--region", default=None, help="cloud region (default: the vendor's configured one)")
    parser.add_argument("--input", dest="inputs", action="append", default=[], type=_input, metavar="NAME=URL",
                        help="a script job's data (repeatable): the platform mounts URL and the job reads its folder "
                             "from SKYLIFT_INPUT_<NAME>, e.g. --input train=s3://bucket/shards")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the exact request (secrets redacted); send nothing")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--watch", action="store_true",
                        help="follow the job; resubmit it after a spot reclaim the platform does not relaunch "
                             "(later, from another terminal: skylift jobs watch JOB)")
    parser.add_argument("--max-resubmits", type=int, default=None, metavar="N",
                        help="--watch: resubmissions after reclaims (default submit.max_resubmits, 3)")
    parser.set_defaults(script_command=[])


def _platform_name(text: str) -> str:
    """The platform's own name for an alias (``kubernetes``: ``k8s``); anything else as given,
    for argparse's choices to refuse with the list."""
    try:
        return resolve_platform(text)
    except SkyliftConfigError:
        return text


def _input(text: str) -> tuple[str, str]:
    name, equals, url = text.partition("=")
    if not equals or not name or not url:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=URL, e.g. --input train=s3://bucket/shards")
    return name, url


SCRIPT_AFTER_DASHES = True
"""``skylift.cli.main`` splits ``-- SCRIPT ARGS`` off before argparse sees it (into
``script_command``): argparse would give the optional CONFIG the first word after ``--``
(and a REMAINDER positional beside it everything after CONFIG, flags included)."""


def execute(args: argparse.Namespace) -> int:
    from skylift.submit.output import exit_code

    return exit_code("submit", lambda: _submit(args))


def _submit(args: argparse.Namespace) -> int:
    from skylift.submit.base import platform_module
    from skylift.submit.output import print_request, print_submitted

    flags = {"image": args.image, "instance_type": args.instance, "instance_count": args.count,
             "gpus_per_node": args.gpus_per_node, "spot": args.spot, "region": args.region,
             "max_resubmits": args.max_resubmits, "inputs": dict(args.inputs) or None}
    job = _job(args, flags)
    platform = platform_module(args.platform)
    request = platform.build(job)
    if args.dry_run:
        print_request(request, as_json=args.json)
        return 0
    ref = platform.send(request, job.options)
    from skylift.submit import records

    record = records.new_record(job, ref, config_path=args.config or args.script_config, overrides=args.overrides,
                                flags=flags)
    saved = _save(record, ref)
    print_submitted(request, ref, as_json=args.json, record=saved)
    if not args.watch:
        return 0
    from skylift.submit.watch import watch

    return watch(platform, job, ref, record=record if saved else None)


def _job(args: argparse.Namespace, flags: dict) -> JobSpec:
    """A config job (CONFIG) or a script job (``-- SCRIPT``), never both, never neither."""
    if args.script_command:
        if args.config:
            raise SkyliftConfigError(f"both a config ({args.config}) and a script after --",
                                     hint=f"A script job reads its fields from --config {args.config}: "
                                     f"skylift submit --platform {args.platform} --config {args.config} ... -- SCRIPT")
        from skylift.submit.script import script_job_from_inputs

        return script_job_from_inputs(args.script_command, args.script_config, args.overrides, flags,
                                      platform=args.platform, command=_command(args))
    if args.script_config:
        raise SkyliftConfigError("--config goes with a script after --",
                                 hint=f"A config job names its config first: skylift submit {args.script_config} "
                                 f"--platform {args.platform} ...")
    if not args.config:
        raise SkyliftConfigError("nothing to submit: no config and no script after --",
                                 hint=f"skylift submit RUN.yaml --platform {args.platform} ...   or: {_SCRIPT_EXAMPLE}")
    from skylift.submit.spec import job_from_inputs

    return job_from_inputs(args.config, args.overrides, flags, platform=args.platform, command=_command(args))


def _command(args: argparse.Namespace) -> list[str]:
    """The ``skylift submit`` command as given (flags in a fixed order), for the error
    that names the one command that would pass."""
    command = ["skylift", "submit", *([args.config] if args.config else []), "--platform", args.platform]
    for flag, value in (("--config", args.script_config), ("--instance", args.instance), ("--count", args.count),
                        ("--gpus-per-node", args.gpus_per_node), ("--image", args.image), ("--region", args.region),
                        ("--max-resubmits", args.max_resubmits)):
        if value is not None:
            command += [flag, str(value)]
    for name, url in args.inputs:
        command += ["--input", f"{name}={url}"]
    for override in args.overrides:
        command += ["--set", _without_secret(override)]
    switches = (("--spot", args.spot), ("--dry-run", args.dry_run), ("--json", args.json), ("--watch", args.watch))
    script = ["--", *args.script_command] if args.script_command else []
    return command + [flag for flag, given in switches if given] + script


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

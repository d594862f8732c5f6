"""``skylift doctor [--json] [--config RUN.yaml]``: what is wrong here, and what to type.

Exit 0 when nothing fails, 1 when a verdict fails (2 for a bad config, as elsewhere).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON (schema_version 1)")
    parser.add_argument(
        "--config", default=None, metavar="RUN.yaml", help="also check this run config against the machine"
    )
    parser.add_argument("--nproc", type=int, default=1, help="worker processes per node the job will use (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes the job will use (default 1)")


def execute(args: argparse.Namespace) -> int:
    from skylift.doctor.gather import gather_facts
    from skylift.doctor.render import exit_code, render_json, render_text
    from skylift.doctor.rules import evaluate
    from skylift.errors import SkyliftConfigError

    if args.nproc < 1 or args.nnodes < 1:
        raise SkyliftConfigError("--nproc and --nnodes must be >= 1", hint="Example: skylift doctor --nproc 8")
    config = None
    if args.config is not None:
        from skylift.config.load import load_config

        config = load_config(args.config)
    facts = gather_facts(config, config_path=args.config, nproc=args.nproc, nnodes=args.nnodes)
    verdicts = evaluate(facts)
    text = render_json(facts, verdicts) if args.json else render_text(facts, verdicts)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `skylift doctor --json | head`: the reader left early
        import os
        import sys

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return exit_code(verdicts)

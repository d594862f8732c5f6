"""``skylift plan CONFIG --epochs E``: rank instances x count x spot by predicted hours and dollars."""

from __future__ import annotations

import argparse
import json
import re
import sys

from skylift.cli.options import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--epochs", type=float, required=True, help="passes over the training set to plan for")
    parser.add_argument("--samples-per-epoch", type=int, default=None,
                        help="training samples per epoch of the real job "
                             "(default: the measured run's dataset)")  # fmt: skip
    parser.add_argument("--deadline", default=None, metavar="8h", help="drop candidates slower than this (h, m, d)")
    parser.add_argument("--budget-usd", type=float, default=None, help="drop candidates dearer than this")
    parser.add_argument("--providers", default=None, metavar="aws,aliyun,tencent", help="only these clouds")
    parser.add_argument("--gpus", default=None, metavar="A100,H100", help="only these GPU models")
    parser.add_argument("--instances", default=None, metavar="TYPE,...", help="only these instance types")
    parser.add_argument("--spot", choices=("auto", "only", "never"), default="auto",
                        help="auto: plan both; only: spot; never: on-demand")  # fmt: skip
    parser.add_argument("--bench", default=None, metavar="FILE|RUN_DIR",
                        help="the measurement to use "
                             "(default: the newest bench of this config; else a new one)")  # fmt: skip
    parser.add_argument("--price-file", default=None, metavar="CSV",
                        help="your own prices over the catalog's (default: plan.price_file)")  # fmt: skip
    parser.add_argument("--efficiency", type=float, default=None,
                        help="fraction of peak FLOP/s the target reaches (default: the one measured here)")  # fmt: skip
    parser.add_argument("--interruptions-per-hour", type=float, default=None,
                        help="spot interruptions per instance-hour (default: plan.interruptions_per_hour, else "
                             "0.05 per provider, an assumption)")  # fmt: skip
    parser.add_argument("--restart-minutes", type=float, default=None,
                        help="minutes from interruption to training (default: plan.restart_minutes, 10)")  # fmt: skip
    parser.add_argument("--machine", choices=("cloud", "local"), default="cloud",
                        help="local: predict this machine at --nproc processes, to check the model here")  # fmt: skip
    parser.add_argument("--nproc", type=int, default=1, help="with --machine local: processes to predict")
    parser.add_argument("--threads", type=int, default=None, help="with --machine local: threads per process")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def execute(args: argparse.Namespace) -> int:
    from skylift.plan.planning import PlanChoices, build_plan
    from skylift.plan.render import render_plan

    choices = PlanChoices(
        config_path=args.config, overrides=tuple(args.overrides), epochs=args.epochs,
        samples_per_epoch=args.samples_per_epoch, deadline_hours=parse_hours(args.deadline),
        budget_usd=args.budget_usd, providers=_names(args.providers), gpus=_names(args.gpus),
        instances=_names(args.instances), spot=args.spot, bench=args.bench, price_file=args.price_file,
        efficiency=args.efficiency, interruptions_per_hour=args.interruptions_per_hour,
        restart_minutes=args.restart_minutes, machine=args.machine, nproc=args.nproc, threads=args.threads,
    )  # fmt: skip
    plan = build_plan(choices, log=lambda text: print(text, file=sys.stderr))
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(render_plan(plan))
    return 0


def _names(text: str | None) -> tuple[str, ...]:
    """``a, b,c`` -> ``("a", "b", "c")``; nothing -> ``()``."""
    return tuple(part.strip() for part in text.split(",") if part.strip()) if text else ()


def parse_hours(text: str | None) -> float | None:
    """``8h``, ``90m``, ``2d`` or a number of hours."""
    from skylift.errors import SkyliftConfigError

    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([hmd]?)\s*", text.lower())
    if not match:
        raise SkyliftConfigError(f"--deadline {text!r}: not a duration",
                                 "write it like 8h, 90m or 2d, e.g. --deadline 8h")
    value, unit = float(match.group(1)), match.group(2) or "h"
    return value * {"h": 1.0, "m": 1 / 60, "d": 24.0}[unit]

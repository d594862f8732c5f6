"""``skylift check CONFIG``: validate and print the resolved config."""

from __future__ import annotations

import argparse
import json

from skylift.cli.options import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")


def execute(args: argparse.Namespace) -> int:
    from skylift.config.load import dump_config, load_config
    from skylift.recipes import check_recipe_args

    config = load_config(args.config, args.overrides)
    check_recipe_args(config)
    print(json.dumps(config.model_dump(mode="json"), indent=2) if args.json else dump_config(config), end="")
    return 0

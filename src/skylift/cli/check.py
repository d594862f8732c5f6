"""``skylift check CONFIG``: validate and print the resolved config (secrets redacted)."""

from __future__ import annotations

import argparse
import json

from skylift.cli.options import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")


def execute(args: argparse.Namespace) -> int:
    import yaml

    from skylift.cloud.redact import redact_config
    from skylift.config.load import load_config
    from skylift.recipes import check_recipe_args

    config = load_config(args.config, args.overrides)
    check_recipe_args(config)
    # Every field, but no secret in clear: submit.envs values and URLs' user-info are redacted.
    resolved = redact_config(config.model_dump(mode="json"))
    print(json.dumps(resolved, indent=2) if args.json else yaml.safe_dump(resolved, sort_keys=False), end="")
    return 0

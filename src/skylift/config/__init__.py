"""Typed, validated run configuration: the schema and its YAML loader."""

from skylift.config.load import apply_overrides, dump_config, load_config, parse_config
from skylift.config.schema import RunConfig

__all__ = ["RunConfig", "apply_overrides", "dump_config", "load_config", "parse_config"]

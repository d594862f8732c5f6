"""Load a :class:`RunConfig` from YAML plus ``--set section.key=value`` overrides.

Errors name the key, the allowed values and the closest valid key, and are raised as
:class:`~skylift.errors.SkyliftConfigError` before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from skylift.config.describe import describe_errors
from skylift.config.moved import MOVED_HINT, moved_key_problems
from skylift.config.schema import RunConfig
from skylift.errors import SkyliftConfigError

__all__ = ["apply_overrides", "dump_config", "load_config", "parse_config"]


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read YAML at ``path`` (``None``: all defaults), apply overrides, validate.

    Example:
        >>> cfg = load_config(None, ["optim.lr=0.01", "schedule.epochs=2"])
        >>> cfg.optim.lr, cfg.schedule.epochs
        (0.01, 2)
    """
    raw: dict[str, Any] = {}
    if path is not None:
        raw = _read_yaml(Path(path))
    config = parse_config(apply_overrides(raw, overrides), source=str(path) if path else "defaults")
    base = Path(path).resolve().parent if path is not None else Path.cwd()
    config.recipe.name = _absolute_file_path(config.recipe.name, base)
    settings = config.recipe.model_extra or {}
    if isinstance(settings.get("model"), str):  # image_classification's model callable may be ./models.py:build
        settings["model"] = _absolute_file_path(settings["model"], base)
    return config


def _absolute_file_path(name: str, base: Path) -> str:
    """``./tasks.py:MyTask`` is relative to the config's folder: make it absolute, so the
    resolved config (and every worker) names the same file wherever it runs from."""
    module, sep, attribute = name.rpartition(":")
    if not sep or not module.endswith(".py") or Path(module).is_absolute():
        return name
    return f"{(base / module).resolve()}:{attribute}"


def parse_config(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a plain mapping into a :class:`RunConfig`."""
    moved = moved_key_problems(raw)
    if moved:
        raise SkyliftConfigError(moved, hint=f"{MOVED_HINT}; then check it with: skylift check {source}")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise SkyliftConfigError(
            describe_errors(error, RunConfig), hint=f"Fix {source}, then check it with: skylift check {source}"
        ) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Return a copy of ``raw`` with each ``dotted.key=value`` applied.

    Values are parsed as YAML scalars (``true``, ``3``, ``null``, ``[a, b]``) and then
    validated with the rest of the config, so types are checked the same way.
    """
    result = _deep_copy(raw)
    for override in overrides:
        key, sep, text = override.partition("=")
        if not sep or not key.strip():
            raise SkyliftConfigError(
                f"override {override!r} is not of the form section.key=value",
                hint="Example: --set optim.lr=0.001",
            )
        try:
            value = _parse_yaml(text) if text.strip() else None
        except yaml.YAMLError as error:
            raise SkyliftConfigError(
                f"--set {override}: the value {text!r} is not valid YAML ({_yaml_problem(error)})",
                hint="Quote a value that holds YAML's special characters, e.g. --set 'run_dir=\"runs/[a]\"'",
            ) from None
        _set_dotted(result, key.strip().split("."), value)
    return result


def dump_config(config: RunConfig) -> str:
    """The resolved config as YAML, every field written out."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise SkyliftConfigError(
            f"config file {str(path)!r} does not exist",
            hint="List the shipped examples with: ls examples/",
        )
    if path.is_dir():
        raise SkyliftConfigError(f"config file {str(path)!r} is a folder, not a YAML file",
                                 hint="Name the YAML file inside it; list the shipped examples with: ls examples/")
    if not path.is_file():  # /dev/null, a FIFO: nothing a config could be read from twice
        raise SkyliftConfigError(f"config file {str(path)!r} is not a regular file",
                                 hint="Name a YAML file; list the shipped examples with: ls examples/")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # an editor's byte-order mark is harmless
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise SkyliftConfigError(
            f"{path} is not UTF-8 text: byte 0x{data[error.start]:02x} at line {line} (a binary file, or "
            "another encoding such as Latin-1)",
            hint=f"Save it as UTF-8, e.g.: iconv -f latin1 -t utf-8 {path} > fixed.yaml",
        ) from None
    try:
        loaded = _parse_yaml(text)
    except yaml.YAMLError as error:
        raise SkyliftConfigError(f"{path} is not valid YAML: {_yaml_problem(error)}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SkyliftConfigError(f"{path} must hold a mapping of sections, not {type(loaded).__name__}")
    return loaded


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: plain YAML keeps
    the last silently, so an edit lower in the file would quietly undo one above."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:  # before merge keys (<<: *anchor) are flattened: those may be overridden
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            earlier = first_line.get(key)
        except TypeError:  # an unhashable key: the base constructor refuses it
            break
        if earlier is not None:
            line = key_node.start_mark.line + 1
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (lines {earlier} and {line}); keep one", None)
        first_line[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # _UniqueKeyLoader is a SafeLoader


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what, and where (its own text spans several lines)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _set_dotted(target: dict[str, Any], parts: list[str], value: Any) -> None:
    node = target
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            dotted = ".".join(parts[: depth + 1])
            raise SkyliftConfigError(f"{dotted} is a value, not a section; cannot set {'.'.join(parts)}")
        node = child
    node[parts[-1]] = value


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return {key: _deep_copy(value) if isinstance(value, dict) else value for key, value in raw.items()}

"""Field paths of the ``--json`` report, for the stability test (and to regenerate the snapshot)."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from skylift.machine.facts import Facts

REPORT_KEYS = ["exit_code", "facts", "schema_version", "skylift_version", "summary", "verdicts"]
VERDICT_KEYS = ["fix", "reason", "rule", "status"]


def field_paths(model: type[BaseModel] = Facts, prefix: str = "facts") -> list[str]:
    """``facts.gpus[].capability``-style paths of every field, nested models expanded."""
    paths = []
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}"
        paths.append(path)
        nested, is_list = _model_of(field.annotation)
        if nested is not None:
            paths += field_paths(nested, f"{path}[]" if is_list else path)
    return sorted(paths)


def _model_of(annotation: object) -> tuple[type[BaseModel] | None, bool]:
    for arg in [annotation, *typing.get_args(annotation)]:
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg, False
        inner = typing.get_args(arg)
        if typing.get_origin(arg) is list and inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            return inner[0], True
    return None, False


if __name__ == "__main__":  # python -m tests.doctor.schema > tests/doctor/schema_v1.txt
    print("\n".join(field_paths()))

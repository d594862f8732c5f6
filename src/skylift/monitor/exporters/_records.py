"""The figures experiment trackers (MLflow, W&B) take from each record, by name."""

from __future__ import annotations

from typing import Any

__all__ = ["flat_params", "scalars_of"]

_TRAIN = ("loss", "lr", "grad_norm", "samples_per_s", "mfu", "step_time_s", "data_wait_s")
_SKIP_EVAL = {"kind", "step", "epoch", "time"}


def scalars_of(record: dict[str, Any]) -> dict[str, float]:
    """``{"train/loss": 0.4, ...}`` for train, eval, cost and system records; {} for other kinds."""
    kind = record.get("kind")
    if kind == "train":
        return {f"train/{name}": float(record[name]) for name in _TRAIN if record.get(name) is not None}
    if kind == "eval":
        return {f"eval/{name}": float(value) for name, value in record.items()
                if name not in _SKIP_EVAL and isinstance(value, (int, float))}
    if kind == "cost":
        return {f"cost/{name}": float(record[name]) for name in ("usd_spent", "projected_usd_total")
                if record.get(name) is not None}
    if kind == "system":
        node = record.get("node_rank", 0)
        out = {f"system/node{node}/cpu_percent": float((record.get("host") or {}).get("cpu_percent") or 0.0)}
        for gpu in record.get("gpus") or []:
            for name in ("utilization_percent", "memory_used_gib", "power_w"):
                if gpu.get(name) is not None:
                    out[f"system/node{node}/gpu{gpu.get('index')}/{name}"] = float(gpu[name])
        return out
    return {}


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The resolved config as ``section.key -> value`` strings (MLflow params)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flat_params(value, f"{name}."))
        else:
            flat[name] = str(value)[:6000]  # MLflow's limit on a param value
    return flat

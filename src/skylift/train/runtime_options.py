"""The keyword arguments of :class:`~skylift.train.runtime.Runtime` that a run configuration
gives (``Runtime.from_config``): where a config key meets the runtime's own parameter."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skylift.train.sharding_options import check_sharding_options

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = ["runtime_options"]


def runtime_options(config: RunConfig) -> dict[str, Any]:
    """``Runtime(**runtime_options(config), context=...)``; every FSDP conflict is refused
    here at once, before the process group starts."""
    checkpointing = config.activation_checkpointing
    if config.distributed.strategy == "fsdp":
        check_sharding_options(precision=config.precision, channels_last=config.channels_last,
                               cpu_offload=config.distributed.fsdp.cpu_offload, ema_decay=config.optim.ema_decay)
    return {
        "precision": config.precision,
        "accumulation_steps": config.accumulation.steps,
        "grad_clip_norm": config.optim.grad_clip_norm,
        "device": config.device,
        "backend": config.distributed.backend,
        "timeout_s": config.distributed.timeout_s,
        "compile": config.compile.enabled,
        "compile_mode": config.compile.mode,
        "channels_last": config.channels_last,
        "activation_checkpointing": checkpointing.module_types if checkpointing.enabled else None,
        "find_unused_parameters": config.distributed.find_unused_parameters,
        "bucket_cap_mib": config.distributed.bucket_cap_mib,
        "strategy": config.distributed.strategy,
        "fsdp": config.distributed.fsdp,
    }

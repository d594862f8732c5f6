"""Everything that can be checked before a process group, GPU or cloud is touched."""

from __future__ import annotations

from typing import Any

import torch

from skylift.config.schema import RunConfig
from skylift.errors import SkyliftConfigError
from skylift.recipes import check_recipe_args
from skylift.train.precision import DeviceInfo, resolve_precision

__all__ = ["preflight"]


def preflight(config: RunConfig, world_size: int) -> dict[str, Any]:
    """Validate what depends on the job's shape and this machine; return the plan.

    Raises:
        SkyliftConfigError: naming each field to change.
    """
    # Token-budget steps hold varying sample counts: global_batch_size plays no part.
    token_budget = config.data.batching == "token_budget"
    try:
        micro_batch = None if token_budget else config.micro_batch_size(world_size)
    except ValueError as error:
        raise SkyliftConfigError(str(error)) from None
    check_recipe_args(config)  # recipe.args (and the user's recipe import), before any worker
    if config.distributed.strategy == "fsdp":
        from skylift.train.sharding import check_sharding_options

        # The Runtime checks again; here the refusal comes before any worker starts (check, --dry-run).
        check_sharding_options(precision=config.precision, channels_last=config.channels_last,
                               cpu_offload=config.distributed.fsdp.cpu_offload, ema_decay=config.optim.ema_decay)
    device = _local_device(config.device)
    policy = resolve_precision(config.precision, DeviceInfo.detect(device))
    return {
        "world_size": world_size,
        "device": device.type,
        "precision": policy.name,
        "precision_reason": policy.reason,
        "grad_scaler": policy.use_grad_scaler,
        "batching": config.data.batching,
        "global_batch_size": None if token_budget else config.data.global_batch_size,
        "micro_batch_size_per_rank": "auto" if config.data.micro_batch_size == "auto" else micro_batch,
        "max_tokens_per_micro_batch": config.data.max_tokens if token_budget else None,
        "accumulation_steps": "auto" if config.data.micro_batch_size == "auto" else (
            None if micro_batch is None else config.data.global_batch_size // (world_size * micro_batch)),
        "epochs": config.schedule.epochs,
        "max_steps": config.schedule.max_steps,
        "run_dir": str(config.run_dir),
    }


def _local_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise SkyliftConfigError(
            "device: cuda was requested but no CUDA GPU is visible",
            hint="Check the driver with `nvidia-smi`, or set device: auto.",
        )
    if requested != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")

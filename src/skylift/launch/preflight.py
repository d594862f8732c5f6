"""Everything that can be checked before a process group, GPU or cloud is touched.

:func:`check_job` needs no torch (``skylift check`` runs it, at once); :func:`preflight`
runs it and then looks at this machine's devices (``skylift run`` and its ``--dry-run``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from skylift.errors import SkyliftConfigError
from skylift.recipes import check_recipe_settings

if TYPE_CHECKING:
    import torch

    from skylift.config.schema import RunConfig

__all__ = ["check_job", "preflight"]


def check_job(config: RunConfig, world_size: int) -> int | None:
    """Validate what depends on the job's shape, not on this machine's devices: the
    batch, the recipe's settings, FSDP's options, every store URL (a local dataset's
    index is read) and the exporters' packages. Returns the micro-batch size per rank
    (None: token-budget batching).

    Raises:
        SkyliftConfigError: naming the field to change.
    """
    # Token-budget steps hold varying sample counts: global_batch_size plays no part.
    token_budget = config.data.batching == "token_budget"
    try:
        micro_batch = None if token_budget else config.micro_batch_size(world_size)
    except ValueError as error:
        raise SkyliftConfigError(str(error)) from None
    check_recipe_settings(config)  # the recipe's settings (and the user's recipe import), before any worker
    if config.distributed.strategy == "fsdp":
        from skylift.train.sharding_options import check_sharding_options

        # The Runtime checks again; here the refusal comes before any worker starts (check, --dry-run).
        check_sharding_options(precision=config.precision, channels_last=config.channels_last,
                               cpu_offload=config.distributed.fsdp.cpu_offload, ema_decay=config.optim.ema_decay)
    _check_stores(config)
    from skylift.monitor.exporters import check_exporters

    check_exporters(config.monitor.exporters)  # the package of each named exporter
    return micro_batch


def preflight(config: RunConfig, world_size: int) -> dict[str, Any]:
    """:func:`check_job`, then what depends on this machine; return the plan.

    Raises:
        SkyliftConfigError: naming each field to change.
    """
    import torch

    from skylift.train.precision import DeviceInfo, resolve_precision

    micro_batch = check_job(config, world_size)
    token_budget = config.data.batching == "token_budget"
    device = _local_device(config.device)
    _check_recipe_device(config, device.type)
    if config.distributed.backend == "nccl" and device.type != "cuda" and world_size > 1:
        raise SkyliftConfigError(
            f"distributed.backend: nccl needs CUDA GPUs, and these {world_size} processes would train on the CPU "
            f"(device: {config.device}, CUDA {'visible' if torch.cuda.is_available() else 'not visible'})",
            hint="Set distributed.backend: auto (NCCL on GPUs, gloo on CPUs) or gloo.",
        )
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


def _check_recipe_device(config: RunConfig, device_type: str) -> None:
    """A recipe setting the resolved device cannot serve (a 4-bit base off CUDA), refused
    before any worker: the settings' optional ``check_device(device_type)``."""
    check = getattr(check_recipe_settings(config), "check_device", None)
    if callable(check):
        check(device_type)


def _check_stores(config: RunConfig) -> None:
    """Each store URL as the run would open it: the scheme, bucket and endpoint (no request
    is sent); a local dataset's ``index.json`` is read, as the run's first step would."""
    from skylift.data.shards import read_index
    from skylift.storage import StorageError, check_store_url, open_store

    urls = [("data.url", config.data.url, config.data.endpoint_url),
            ("data.val_url", config.data.val_url, config.data.endpoint_url)]
    if config.checkpoint.enabled and config.checkpoint.root:
        urls.append(("checkpoint.root", config.checkpoint.root, config.checkpoint.endpoint_url))
    for field, url, endpoint_url in urls:
        if not url:
            continue
        try:
            check_store_url(url, endpoint_url=endpoint_url, endpoint_field=f"{field.split('.')[0]}.endpoint_url")
            if field.startswith("data.") and ("://" not in url or url.startswith("file://")):
                read_index(open_store(url))
        except (StorageError, ValueError) as error:
            raise SkyliftConfigError(f"{field}: {error}") from None


def _local_device(requested: str) -> torch.device:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SkyliftConfigError(
            "device: cuda was requested but no CUDA GPU is visible",
            hint="Check the driver with `nvidia-smi`, or set device: auto.",
        )
    if requested != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")

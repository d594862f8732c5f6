"""What ``distributed.strategy: fsdp`` refuses, checked without torch (``skylift check``
and the run's preflight reach it before any worker; the Runtime checks again)."""

from __future__ import annotations

from skylift.errors import SkyliftConfigError

__all__ = ["check_sharding_options"]


def check_sharding_options(*, precision: str, channels_last: bool, cpu_offload: bool,
                           ema_decay: float | None = None) -> None:  # fmt: skip
    """Refuse, before any work, what ``strategy: fsdp`` cannot train correctly.

    Raises:
        SkyliftConfigError: naming every conflicting field and its fix.
    """
    problems = []
    if ema_decay is not None:
        problems.append(
            "optim.ema_decay with distributed.strategy: fsdp: the average would be a second, unsharded copy of "
            "the model on every rank (the memory FSDP exists to save); set optim.ema_decay: null, or strategy: ddp")
    if channels_last:
        problems.append("channels_last with distributed.strategy: fsdp: FSDP2 shards only contiguous parameters "
                        "(torch 2.14 raises on channels-last conv weights); set channels_last: false")
    if precision == "fp16" and cpu_offload:
        problems.append(
            "precision: fp16 with distributed.fsdp.cpu_offload: the loss scaler's overflow check over gradients "
            "in host memory is untested here; use precision: bf16 (no scaler), or cpu_offload: false")
    if problems:
        raise SkyliftConfigError(problems)

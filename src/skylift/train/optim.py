"""Optimizer and learning-rate schedule from the config."""

from __future__ import annotations

import math

import torch
from torch import nn

from skylift.config.schema import OptimConfig, ScheduleConfig

__all__ = ["build_lr_schedule", "build_optimizer", "lr_multiplier"]


def build_optimizer(model: nn.Module, config: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW or SGD with the fastest kernel family the device has.

    Weight decay skips biases and normalisation weights (1-D parameters), the usual
    practice for conv nets and transformers alike.
    """
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kernel = _kernel_options(config.implementation, device)
    if config.name == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, **kernel)
    return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, nesterov=config.nesterov, **kernel)


def lr_multiplier(step: int, schedule: ScheduleConfig, total_steps: int) -> float:
    """Factor applied to the peak LR after ``step`` optimizer steps."""
    warmup = schedule.warmup_steps
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    floor = schedule.min_lr_ratio
    if schedule.lr_schedule == "warmup_cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * (1.0 - progress)


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, schedule: ScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, schedule, total_steps)
    )


def _kernel_options(implementation: str, device: torch.device) -> dict[str, bool]:
    if implementation == "auto":
        implementation = "fused" if device.type == "cuda" else "foreach"
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"}

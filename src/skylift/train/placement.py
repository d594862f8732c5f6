"""Where a model runs and in which numeric format: the device, precision, memory layout, compile.

What changes with the machine and not with the loop: :class:`~skylift.train.runtime.Runtime`
holds one, and the Trainer's micro-batch trials measure the model as this places it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from skylift.train.model_tools import apply_activation_checkpointing
from skylift.train.precision import DeviceInfo, PrecisionPolicy, resolve_precision

__all__ = ["Placement"]


class Placement:
    """The device, the precision policy (its global flags applied), channels-last,
    activation checkpointing and ``torch.compile`` of one process's model."""

    def __init__(self, device: torch.device, precision: str = "auto", *, channels_last: bool = False,
                 activation_checkpointing: list[str] | None = None, compile: bool = False,
                 compile_mode: str = "default") -> None:  # fmt: skip
        self.device = device
        self.precision: PrecisionPolicy = resolve_precision(precision, DeviceInfo.detect(device))
        self.precision.apply_global_flags()
        self.channels_last = channels_last
        self.checkpoint_types = activation_checkpointing or []
        self.compile, self.compile_mode = compile, compile_mode

    def new_grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 needs its loss scaled so small gradients do not underflow; the others do not."""
        return torch.amp.GradScaler(self.device.type) if self.precision.use_grad_scaler else None

    def place(self, model: nn.Module) -> nn.Module:
        """Activation checkpointing, the device and the memory format, without wrappers;
        idempotent, so the model can be measured as it will train before it is wrapped."""
        if getattr(model, "_skylift_placed", False):
            return model
        if self.checkpoint_types:
            apply_activation_checkpointing(model, self.checkpoint_types)
        if not any(parameter.is_meta for parameter in model.parameters()):
            model = model.to(self.device)  # a model on meta gets its memory when sharded (train.sharding)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        # Module.__setattr__ takes any value; torch's annotation names only tensors and modules.
        model._skylift_placed = True  # type: ignore[assignment]
        return model

    def compiled(self, model: nn.Module) -> nn.Module:
        """``model`` under ``torch.compile`` when asked for (outermost, around any DDP wrapper)."""
        # torch.compile of a module returns a module (an OptimizedModule); its annotation says Callable.
        return cast(nn.Module, torch.compile(model, mode=self.compile_mode)) if self.compile else model

    def to_device(self, batch: Any) -> Any:
        """Move tensors (in tuples, lists and dicts) to the device, asynchronously when pinned."""
        if isinstance(batch, torch.Tensor):
            moved = batch.to(self.device, non_blocking=True)
            if self.channels_last and moved.dim() == 4 and moved.is_floating_point():
                moved = moved.contiguous(memory_format=torch.channels_last)
            return moved
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(item) for item in batch)
        if isinstance(batch, dict):
            return {key: self.to_device(value) for key, value in batch.items()}
        return batch

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        with self.precision.autocast(self.device.type):
            yield

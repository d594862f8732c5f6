"""Accumulation and DDP or FSDP: which micro-step reduces gradients, how the loss is scaled, and the step.

What changes with the job's batch shape, world size and sharding strategy:
:class:`~skylift.train.runtime.Runtime` holds one and calls it from ``autocast``,
``backward`` and ``optimizer_step``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from skylift.loop.collectives import collective
from skylift.loop.distributed import DistributedContext
from skylift.train.sharding import Sharding, clip_gradients, global_grad_norm, local_gradients

__all__ = ["GradientStep"]


class GradientStep:
    """Micro-steps per optimizer step, the DDP wrapper or FSDP sharding, the GradScaler and clipping.

    ``optimizer`` and ``scheduler`` are set when the runtime's ``prepare`` sees them;
    ``sharding`` (``distributed.strategy: fsdp``) replaces DDP."""

    def __init__(self, *, accumulation_steps: int = 1, grad_clip_norm: float | None = None,
                 scaler: torch.amp.GradScaler | None = None, find_unused_parameters: bool = False,
                 bucket_cap_mib: int = 25, sharding: Sharding | None = None) -> None:  # fmt: skip
        self.accumulation_steps = accumulation_steps
        self.grad_clip_norm = grad_clip_norm
        self.scaler = scaler
        self.last_grad_norm: torch.Tensor | None = None
        self.last_lr = 0.0
        self.micro_step = 0
        self.ddp: DistributedDataParallel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.sharding = sharding
        self._device = torch.device("cpu")
        self.collective_device = torch.device("cpu")
        """Where tensors for collectives on the default group live (NCCL: the device; gloo: host)."""
        self._parameters: list[nn.Parameter] = []
        self._ddp_options: dict[str, Any] = {"find_unused_parameters": find_unused_parameters,
                                             "bucket_cap_mb": bucket_cap_mib}

    @property
    def sync_gradients(self) -> bool:
        """True on the last micro-step of an accumulation group (the one that steps)."""
        return self.micro_step == self.accumulation_steps - 1

    def wrap(self, model: nn.Module, context: DistributedContext) -> nn.Module:
        """``model`` (placed) sharded in place under FSDP (on any number of ranks), or under
        DDP when there are several ranks; its trainable parameters are the ones clipping reads."""
        self._device = context.device
        if self.sharding is not None:
            model = self.sharding.apply(model)
            self.collective_device = _collective_device(context.device)
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        if self.sharding is not None or not context.is_distributed:
            return model
        device_ids = [context.device.index] if context.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids, **self._ddp_options)
        return self.ddp

    def before_forward(self) -> None:
        if self.sharding is not None:
            self.sharding.set_gradient_sync(self.sync_gradients)
        if self.ddp is not None:
            # Must be set before forward: DDP reads it there to arm the gradient hooks.
            self.ddp.require_backward_grad_sync = self.sync_gradients

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the micro-step loss, averaged over the accumulation group."""
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        # DDP all-reduces the gradients from hooks inside backward.
        with collective("the gradient all-reduce (DDP, in backward)") if self.ddp is not None else nullcontext():
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()

    def step(self) -> bool:
        """Step at the end of an accumulation group (unscale, clip, step, update the
        scaler, zero the gradients, step the LR scheduler); return whether it stepped."""
        if not self.sync_gradients:
            self.micro_step += 1
            return False
        self.micro_step = 0
        optimizer = self.require_optimizer()
        self.last_lr = optimizer.param_groups[0]["lr"]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if self.grad_clip_norm is not None:
            self.last_grad_norm = self._clip(self.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return True

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Clip to the global norm (over every rank's slices under FSDP); return it before the clip."""
        gradients = local_gradients(self._parameters)
        total = global_grad_norm(gradients, self._device, sharded=self.sharding is not None,
                                 reduce_device=self.collective_device)  # fmt: skip
        clip_gradients(gradients, max_norm, total)
        return total

    def require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError("Runtime.optimizer_step() needs the optimizer: pass it to runtime.prepare(...)")
        return self.optimizer


def _collective_device(device: torch.device) -> torch.device:
    """Where a tensor for a collective on the default group lives: NCCL reduces device
    tensors only, gloo host tensors."""
    return device if device.type == "cuda" and "nccl" in str(dist.get_backend()) else torch.device("cpu")

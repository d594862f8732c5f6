"""The small runtime for users who keep their own training loop.

Example, the whole contract::

    runtime = Runtime(precision="auto", accumulation_steps=4, grad_clip_norm=1.0)
    model, optimizer, loader, scheduler = runtime.prepare(model, optimizer, loader, scheduler)
    for inputs, targets in loader:
        with runtime.autocast():
            loss = loss_fn(model(inputs), targets)
        runtime.backward(loss)
        runtime.optimizer_step()   # steps only on the last micro-batch of each group
    runtime.close()

``autocast()`` also tells DDP whether this micro-step all-reduces gradients (only the
last of each accumulation group does), ``backward`` scales the loss for accumulation
and fp16, and ``optimizer_step`` unscales, clips, steps, updates the GradScaler,
zeroes gradients and steps the LR scheduler.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from skylift.train.distributed import DistributedContext, exit_cleanly, init_distributed
from skylift.train.model_tools import apply_activation_checkpointing
from skylift.train.precision import DeviceInfo, PrecisionPolicy, resolve_precision

__all__ = ["Runtime"]

log = logging.getLogger("skylift")


class Runtime:
    """Precision, accumulation, DDP and clipping for a hand-written loop.

    Args:
        precision: ``auto``, ``fp32``, ``tf32``, ``fp16`` or ``bf16`` (see
            :func:`~skylift.train.precision.resolve_precision`).
        accumulation_steps: micro-batches per optimizer step.
        grad_clip_norm: clip the global gradient norm to this (``None``: no clipping).
        device: ``auto``, ``cpu`` or ``cuda``.
        compile: wrap the model in ``torch.compile``.
        channels_last: convert conv nets to the channels-last memory format.
        activation_checkpointing: class names of submodules to recompute in backward.
        context: an already initialised :class:`DistributedContext` (else read from
            the torchrun environment).
    """

    def __init__(
        self,
        *,
        precision: str = "auto",
        accumulation_steps: int = 1,
        grad_clip_norm: float | None = None,
        device: str = "auto",
        backend: str = "auto",
        timeout_s: float = 600.0,
        compile: bool = False,
        compile_mode: str = "default",
        channels_last: bool = False,
        activation_checkpointing: list[str] | None = None,
        find_unused_parameters: bool = False,
        bucket_cap_mib: int = 25,
        context: DistributedContext | None = None,
    ) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.dist = context or init_distributed(device, backend, timeout_s)
        self.device = self.dist.device
        self.precision: PrecisionPolicy = resolve_precision(precision, DeviceInfo.detect(self.device))
        self.precision.apply_global_flags()
        self.accumulation_steps = accumulation_steps
        self.grad_clip_norm = grad_clip_norm
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision.use_grad_scaler else None
        self.last_grad_norm: torch.Tensor | None = None
        self._compile, self._compile_mode = compile, compile_mode
        self._channels_last = channels_last
        self._checkpoint_types = activation_checkpointing or []
        self._ddp_options = {"find_unused_parameters": find_unused_parameters, "bucket_cap_mb": bucket_cap_mib}
        self._micro_step = 0
        self._ddp: DistributedDataParallel | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._parameters: list[nn.Parameter] = []

    @classmethod
    def from_config(cls, config: Any, context: DistributedContext | None = None) -> Runtime:
        """Build from a :class:`~skylift.config.RunConfig`."""
        checkpointing = config.activation_checkpointing
        return cls(
            precision=config.precision,
            accumulation_steps=config.accumulation.steps,
            grad_clip_norm=config.optim.grad_clip_norm,
            device=config.device,
            backend=config.distributed.backend,
            timeout_s=config.distributed.timeout_s,
            compile=config.compile.enabled,
            compile_mode=config.compile.mode,
            channels_last=config.channels_last,
            activation_checkpointing=checkpointing.module_types if checkpointing.enabled else None,
            find_unused_parameters=config.distributed.find_unused_parameters,
            bucket_cap_mib=config.distributed.bucket_cap_mib,
            context=context,
        )

    @property
    def sync_gradients(self) -> bool:
        """True on the last micro-step of an accumulation group (the one that steps)."""
        return self._micro_step == self.accumulation_steps - 1

    def prepare(self, model: nn.Module, *objects: Any) -> Any:
        """Move and wrap the model; register the optimizer, data loader and scheduler.

        Returns the model followed by the other objects in the order given.
        """
        prepared: list[Any] = [self.prepare_model(model)]
        for item in objects:
            if isinstance(item, torch.optim.Optimizer):
                self._optimizer = item
            elif isinstance(item, DataLoader):
                item = self.prepare_dataloader(item)
            elif item is not None and hasattr(item, "step") and hasattr(item, "get_last_lr"):
                self._scheduler = item
            prepared.append(item)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if self._checkpoint_types:
            apply_activation_checkpointing(model, self._checkpoint_types)
        model = model.to(self.device)
        if self._channels_last:
            model = model.to(memory_format=torch.channels_last)
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        if self.dist.is_distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=device_ids, **self._ddp_options)
            self._ddp = model
        if self._compile:
            model = torch.compile(model, mode=self._compile_mode)
        return model

    def prepare_dataloader(self, loader: DataLoader) -> _DeviceLoader:
        """Shard a plain loader across ranks and move its batches to the device."""
        batch_sampler = getattr(loader, "batch_sampler", None)
        already_sharded = getattr(batch_sampler, "shards_by_rank", False) or isinstance(
            getattr(loader, "sampler", None), DistributedSampler
        )
        if self.dist.is_distributed and not already_sharded:
            loader = _shard_loader(loader, self.dist)
        return _DeviceLoader(loader, self)

    def to_device(self, batch: Any) -> Any:
        """Move tensors (in tuples, lists and dicts) to the device, asynchronously when pinned."""
        if isinstance(batch, torch.Tensor):
            moved = batch.to(self.device, non_blocking=True)
            if self._channels_last and moved.dim() == 4 and moved.is_floating_point():
                moved = moved.contiguous(memory_format=torch.channels_last)
            return moved
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(item) for item in batch)
        if isinstance(batch, dict):
            return {key: self.to_device(value) for key, value in batch.items()}
        return batch

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the forward pass of one micro-step: autocast plus the DDP sync decision."""
        if self._ddp is not None:
            # Must be set before forward: DDP reads it there to arm the gradient hooks.
            self._ddp.require_backward_grad_sync = self.sync_gradients
        with self.precision.autocast(self.device.type):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the micro-step loss, averaged over the accumulation group."""
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def optimizer_step(self) -> bool:
        """Step at the end of an accumulation group; return whether it stepped."""
        if not self.sync_gradients:
            self._micro_step += 1
            return False
        self._micro_step = 0
        optimizer = self._require_optimizer()
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        if self.grad_clip_norm is not None:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self._parameters, self.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self._scheduler is not None:
            self._scheduler.step()
        return True

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module under any compile and DDP wrappers."""
        model = getattr(model, "_orig_mod", model)
        return model.module if isinstance(model, DistributedDataParallel) else model

    def close(self, exit_code: int = 0) -> None:
        """End the process cleanly (barrier, destroy the group, flush, exit)."""
        exit_cleanly(exit_code)

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise RuntimeError("Runtime.optimizer_step() needs the optimizer: pass it to runtime.prepare(...)")
        return self._optimizer


class _DeviceLoader:
    """Iterate a DataLoader with batches already on the runtime's device."""

    def __init__(self, loader: DataLoader, runtime: Runtime) -> None:
        self.loader = loader
        self._runtime = runtime

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self._runtime.to_device(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _shard_loader(loader: DataLoader, context: DistributedContext) -> DataLoader:
    if loader.batch_size is None:
        raise ValueError(
            "Runtime.prepare cannot shard a DataLoader built with a custom batch_sampler; "
            "give it a sampler with shards_by_rank = True or a DistributedSampler"
        )
    sampler = DistributedSampler(
        loader.dataset,
        num_replicas=context.world_size,
        rank=context.rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        drop_last=loader.drop_last,
    )
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        persistent_workers=loader.persistent_workers,
    )

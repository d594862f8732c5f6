"""Model FLOPs per step and the device's peak, the two halves of MFU.

FLOPs are counted once, with :class:`torch.utils.flop_counter.FlopCounterMode`, on a
copy of the training step that runs on the ``meta`` device: no arithmetic, no
gradients or buffers of the real model touched, no random numbers drawn (so a
resumed run stays bitwise equal to an uninterrupted one).

Peaks are dense (no 2:4 sparsity) per-GPU figures from NVIDIA's data sheets; on a
CPU the peak is measured with a large matmul in the run's dtype.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from skylift.machine.gpus import GPU_PEAK_TFLOPS, precision_class

__all__ = ["Peak", "count_step_flops", "device_peak", "measure_cpu_peak_flops"]

log = logging.getLogger("skylift")


@dataclass(frozen=True)
class Peak:
    flops_per_s: float | None
    """Peak of one device, or ``None`` when unknown."""
    source: str
    """``table:<entry>``, ``measured:cpu-matmul``, or ``unknown: <why>``."""


def device_peak(device: torch.device, precision: str) -> Peak:
    """The peak FLOP/s of one device at ``precision`` (``fp32``, ``tf32``, ``fp16``, ``bf16``)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak(name, precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return Peak(measure_cpu_peak_flops(dtype), f"measured:cpu-matmul-{str(dtype).removeprefix('torch.')}")


def gpu_peak(name: str, precision: str) -> Peak:
    lowered = name.lower()
    for fragment, peaks in GPU_PEAK_TFLOPS.items():
        if fragment in lowered:
            return Peak(peaks[precision_class(precision)] * 1e12, f"table:{fragment}")
    return Peak(None, f"unknown: no peak listed for GPU {name!r}")


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, budget_s: float = 0.3) -> float:
    """Best matmul rate over a short loop, with the threads torch uses for training."""
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(dtype)
    b = a.clone()
    flops = 2.0 * size**3
    torch.mm(a, b)  # first call pays for allocation and kernel selection
    best_s = float("inf")
    deadline = time.perf_counter() + budget_s
    repeats = 0
    while repeats < 3 or (time.perf_counter() < deadline and repeats < 50):
        started = time.perf_counter()
        torch.mm(a, b)
        best_s = min(best_s, time.perf_counter() - started)
        repeats += 1
    return flops / best_s


def count_step_flops(
    module: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]
) -> float | None:
    """FLOPs of forward + backward of ``loss_fn(module, batch)`` for one micro-batch.

    Runs on meta tensors; returns ``None`` (and says why at debug level) when an
    operation of the model has no meta implementation.
    """
    from torch.utils.flop_counter import FlopCounterMode

    params = {name: _meta_like(p).requires_grad_(p.requires_grad) for name, p in module.named_parameters()}
    buffers = {name: _meta_like(b) for name, b in module.named_buffers()}
    meta_batch = tree_map(lambda x: _meta_like(x) if isinstance(x, torch.Tensor) else x, batch)
    shadow = _Functional(module, {**params, **buffers})
    # Meta kernels draw no random numbers; the fork makes sure a recipe's own code can't either.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), FlopCounterMode(display=False) as counter:
            loss = loss_fn(shadow, meta_batch)
            loss.backward()
    except Exception as error:  # noqa: BLE001 - an op without a meta kernel must not stop training
        log.debug("FLOP counting failed (%s); MFU will not be reported", error)
        return None
    total = float(counter.get_total_flops())
    return total if total > 0 else None


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")


class _Functional(nn.Module):
    """Calls ``module`` with replacement parameters, so the recipe's loss can run on meta."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._wrapped = [module]  # a list: not registered as a submodule
        self._tensors = tensors
        self.training = module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.func import functional_call

        return functional_call(self._wrapped[0], self._tensors, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._wrapped[0], name)

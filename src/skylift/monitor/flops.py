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

__all__ = [
    "GPU_MEMORY_BANDWIDTH_GB_S",
    "GPU_PEAK_TFLOPS",
    "GPU_SPEC_SOURCES",
    "GpuSpec",
    "Peak",
    "count_step_flops",
    "device_peak",
    "gpu_spec",
    "measure_cpu_peak_flops",
]

log = logging.getLogger("skylift")

GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # name fragment (matched in order, lower case) -> dense TFLOP/s per precision class
    "h200": {"half": 989.0, "tf32": 494.7, "fp32": 66.9},
    "h100 pcie": {"half": 756.0, "tf32": 378.0, "fp32": 51.2},
    "h100": {"half": 989.0, "tf32": 494.7, "fp32": 66.9},
    "a100-80gb": {"half": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a100": {"half": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a10g": {"half": 70.0, "tf32": 35.0, "fp32": 31.2},
    "a10": {"half": 125.0, "tf32": 62.5, "fp32": 31.2},
    "l40s": {"half": 362.05, "tf32": 183.0, "fp32": 91.6},  # before "l4": "l40s" contains it
    "l4": {"half": 121.0, "tf32": 60.0, "fp32": 30.3},
    "t4": {"half": 65.0, "tf32": 8.1, "fp32": 8.1},
    "v100": {"half": 125.0, "tf32": 15.7, "fp32": 15.7},
}
"""Dense tensor-core peaks. ``half`` covers fp16 and bf16 (T4 and V100 have no bf16
tensor cores: the fp16 figure is their best case); ``tf32`` falls back to the fp32
figure on GPUs without TensorFloat-32."""

GPU_MEMORY_BANDWIDTH_GB_S: dict[str, float] = {
    # same fragments as GPU_PEAK_TFLOPS -> device memory bandwidth, GB/s (10^9 bytes/s)
    "h200": 4800.0,
    "h100 pcie": 2000.0,
    "h100": 3350.0,
    "a100-80gb": 2039.0,
    "a100": 1555.0,
    "a10g": 600.0,
    "a10": 600.0,
    "l40s": 864.0,
    "l4": 300.0,
    "t4": 320.0,
    "v100": 900.0,
}
"""Data-sheet memory bandwidth (SXM parts unless the fragment says PCIe); the planner
scales memory-bound work (the optimizer step) by it."""

GPU_SPEC_SOURCES: dict[str, str] = {
    "h200": "https://www.nvidia.com/en-us/data-center/h200/",
    "h100 pcie": "https://www.nvidia.com/en-us/data-center/h100/",
    "h100": "https://www.nvidia.com/en-us/data-center/h100/",
    "a100-80gb": "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    "a100": "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
    "a10g": "https://aws.amazon.com/ec2/instance-types/g5/",
    "a10": "https://www.nvidia.com/en-us/data-center/products/a10-gpu/",
    "l40s": "https://www.nvidia.com/en-us/data-center/l40s/",
    "l4": "https://www.nvidia.com/en-us/data-center/l4/",
    "t4": "https://www.nvidia.com/en-us/data-center/tesla-t4/",
    "v100": "https://www.nvidia.com/en-us/data-center/v100/",
}
"""Where each row of the two tables above was read (NVIDIA data sheets; A10G: AWS)."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's figures from the shared tables (catalog, planner and MFU use the same)."""

    table_entry: str
    """The fragment of ``GPU_PEAK_TFLOPS`` that matched."""
    peak_tflops: dict[str, float]
    """Dense TFLOP/s per precision class (``half``, ``tf32``, ``fp32``)."""
    memory_bandwidth_bytes_per_s: float
    source: str

    def peak_flops_per_s(self, precision: str) -> float:
        """Dense peak at ``precision`` (``fp32``, ``tf32``, ``fp16``, ``bf16``), FLOP/s."""
        return self.peak_tflops[precision_class(precision)] * 1e12


def gpu_spec(name: str) -> GpuSpec | None:
    """The table figures for a GPU named ``name`` (``"A100"``, ``"NVIDIA L40S"``), or None."""
    lowered = name.lower()
    for fragment, peaks in GPU_PEAK_TFLOPS.items():
        if fragment in lowered:
            bandwidth_bytes_per_s = GPU_MEMORY_BANDWIDTH_GB_S[fragment] * 1e9
            return GpuSpec(fragment, dict(peaks), bandwidth_bytes_per_s, GPU_SPEC_SOURCES[fragment])
    return None


@dataclass(frozen=True)
class Peak:
    flops_per_s: float | None
    """Peak of one device, or ``None`` when unknown."""
    source: str
    """``table:<entry>``, ``measured:cpu-matmul``, or ``unknown: <why>``."""


def precision_class(precision: str) -> str:
    return {"fp16": "half", "bf16": "half", "tf32": "tf32"}.get(precision, "fp32")


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

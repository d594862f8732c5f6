"""Choose the numeric format from the device, and say why.

``auto`` picks what the hardware runs natively: bf16 on CUDA compute capability
>= 8.0 (Ampere and newer), fp16 with a GradScaler on 7.x (V100, T4), bf16 autocast
on CPUs with native bf16 (AVX512-BF16 or AMX, as PyTorch's kernels see them), else
fp32. An explicit request the device cannot honour is an error, never ignored.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from skylift.errors import SkyliftConfigError

__all__ = ["DeviceInfo", "PrecisionPolicy", "resolve_precision"]

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# ATen dispatches to AVX512 kernels (which carry the bf16 paths) only at these levels;
# ATEN_CPU_CAPABILITY=avx2 disables them even on a CPU that has the instructions.
_CPU_BF16_CAPABILITIES = ("AVX512", "AVX512_BF16", "AMX")


@dataclass(frozen=True)
class DeviceInfo:
    """What the precision choice depends on."""

    type: Literal["cpu", "cuda"]
    name: str
    cuda_capability: tuple[int, int] | None = None
    cpu_native_bf16: bool = False

    @classmethod
    def detect(cls, device: torch.device) -> DeviceInfo:
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            return cls("cuda", torch.cuda.get_device_name(device), cuda_capability=capability)
        return cls("cpu", _cpu_name(), cpu_native_bf16=_cpu_has_native_bf16())


@dataclass(frozen=True)
class PrecisionPolicy:
    """A resolved precision: what autocast runs in and whether gradients are scaled."""

    name: Literal["fp32", "tf32", "fp16", "bf16"]
    autocast_dtype: torch.dtype | None
    use_grad_scaler: bool
    allow_tf32: bool
    reason: str

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager[None]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)

    def apply_global_flags(self) -> None:
        """Set process-wide matmul flags this policy implies (TF32 on or off)."""
        torch.backends.cuda.matmul.allow_tf32 = self.allow_tf32
        torch.backends.cudnn.allow_tf32 = self.allow_tf32


def resolve_precision(requested: str, device: DeviceInfo) -> PrecisionPolicy:
    """Turn ``precision`` from the config into a policy for ``device``.

    Raises:
        SkyliftConfigError: the device cannot run the requested format.

    Example:
        >>> resolve_precision("auto", DeviceInfo("cuda", "NVIDIA A100", (8, 0))).name
        'bf16'
    """
    if requested == "auto":
        return _auto(device)
    if requested == "fp32":
        return PrecisionPolicy("fp32", None, False, False, "requested in the config")
    if requested == "tf32":
        return _tf32(device)
    if requested == "bf16":
        return _bf16(device, "requested in the config")
    if requested == "fp16":
        return PrecisionPolicy("fp16", torch.float16, True, False, "requested in the config")
    raise SkyliftConfigError(f"precision: unknown value {requested!r}; allowed: auto, fp32, tf32, fp16, bf16")


def _auto(device: DeviceInfo) -> PrecisionPolicy:
    if device.type == "cuda":
        major, minor = device.cuda_capability or (0, 0)
        if major >= 8:
            return _bf16(device, f"auto: {device.name} (compute capability {major}.{minor}) runs bf16 natively")
        if major == 7:
            reason = f"auto: {device.name} (compute capability {major}.{minor}) has fp16 tensor cores but no bf16"
            return PrecisionPolicy("fp16", torch.float16, True, False, reason)
        return PrecisionPolicy("fp32", None, False, False, f"auto: {device.name} has no fast half precision")
    if device.cpu_native_bf16:
        return _bf16(device, "auto: this CPU has native bf16 (AVX512-BF16/AMX) and PyTorch uses it")
    return PrecisionPolicy("fp32", None, False, False, "auto: this CPU has no native bf16, so fp32")


def _bf16(device: DeviceInfo, reason: str) -> PrecisionPolicy:
    if device.type == "cuda":
        major, minor = device.cuda_capability or (0, 0)
        if major < 8:
            raise SkyliftConfigError(
                f"precision: bf16 needs CUDA compute capability >= 8.0, but {device.name} is {major}.{minor}",
                hint="Set precision: fp16 (with a GradScaler) or precision: auto.",
            )
        return PrecisionPolicy("bf16", torch.bfloat16, False, True, reason)
    if not device.cpu_native_bf16:
        raise SkyliftConfigError(
            f"precision: bf16 was requested but this CPU ({device.name}) has no native bf16 "
            "(AVX512-BF16 or AMX usable by PyTorch); emulated bf16 is slower than fp32",
            hint="Set precision: fp32 or precision: auto.",
        )
    return PrecisionPolicy("bf16", torch.bfloat16, False, False, reason)


def _tf32(device: DeviceInfo) -> PrecisionPolicy:
    if device.type != "cuda" or (device.cuda_capability or (0, 0))[0] < 8:
        raise SkyliftConfigError(
            f"precision: tf32 needs an NVIDIA GPU with compute capability >= 8.0; {device.name} has none",
            hint="Set precision: fp32 or precision: auto.",
        )
    return PrecisionPolicy("tf32", None, False, True, "requested in the config")


def _cpu_flags() -> set[str]:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _cpu_has_native_bf16() -> bool:
    has_instructions = any(flag in _cpu_flags() for flag in _CPU_BF16_FLAGS)
    return has_instructions and torch.backends.cpu.get_cpu_capability() in _CPU_BF16_CAPABILITIES


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "CPU"

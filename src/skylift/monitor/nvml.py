"""NVIDIA's management library (``nvidia-ml-py``), imported lazily and optional.

Every query may be unsupported on a given GPU (PCIe counters on some cloud VMs,
power on MIG slices): each figure is read on its own and left ``None`` when NVML
says no, rather than losing the whole sample.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["Nvml"]

log = logging.getLogger("skylift")

_GIB = 1024**3


class Nvml:
    """Handles to the node's GPUs; ``available`` is False (with ``reason``) without NVML."""

    def __init__(self) -> None:
        self.available = False
        self.reason = ""
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
        except pynvml.NVMLError as error:
            self.reason = f"NVML unavailable ({error}): no NVIDIA driver on this machine"
            return
        self._nvml = pynvml
        self.available = bool(self._handles)
        if not self.available:
            self.reason = "NVML found no GPU"

    def sample(self) -> list[dict[str, Any]]:
        """One figure set per GPU (see :class:`skylift.monitor.schema.GpuFigures`)."""
        return [self._sample_one(index, handle) for index, handle in enumerate(self._handles)]

    def close(self) -> None:
        if self._nvml is not None:
            self._try(self._nvml.nvmlShutdown)
            self._nvml = None

    def _sample_one(self, index: int, handle: Any) -> dict[str, Any]:
        nvml = self._nvml
        name = self._try(lambda: nvml.nvmlDeviceGetName(handle))
        utilization = self._try(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        memory = self._try(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power_mw = self._try(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        rx_kb_s = self._try(lambda: nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES))
        tx_kb_s = self._try(lambda: nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_TX_BYTES))
        return {
            "index": index,
            "name": name.decode() if isinstance(name, bytes) else str(name or "unknown"),
            "utilization_percent": _field(utilization, "gpu"),
            "memory_used_gib": _scaled(_field(memory, "used"), _GIB),
            "memory_total_gib": _scaled(_field(memory, "total"), _GIB),
            "power_w": _scaled(power_mw, 1000),
            "temperature_c": self._try(lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
            "sm_clock_mhz": self._try(lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)),
            "pcie_rx_mb_s": _scaled(rx_kb_s, 1000),
            "pcie_tx_mb_s": _scaled(tx_kb_s, 1000),
        }

    def _try(self, query: Callable[[], Any]) -> Any:
        try:
            return query()
        except self._nvml.NVMLError:
            return None


def _field(value: Any, name: str) -> Any:
    return None if value is None else getattr(value, name, None)


def _scaled(value: float | None, divisor: float) -> float | None:
    return None if value is None else round(value / divisor, 3)

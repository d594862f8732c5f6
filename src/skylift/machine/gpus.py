"""Data-sheet figures of the GPU models skylift knows: dense peaks and memory bandwidth.

Torch-free facts of the hardware, shared by the catalog, the planner and MFU
(:mod:`skylift.monitor.flops`), so each reads the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "GPU_MEMORY_BANDWIDTH_GB_S",
    "GPU_PEAK_TFLOPS",
    "GPU_SPEC_SOURCES",
    "GpuSpec",
    "gpu_spec",
    "precision_class",
]

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


def precision_class(precision: str) -> str:
    """``half`` (fp16, bf16), ``tf32`` or ``fp32``: the column of ``GPU_PEAK_TFLOPS`` a precision reads."""
    return {"fp16": "half", "bf16": "half", "tf32": "tf32"}.get(precision, "fp32")

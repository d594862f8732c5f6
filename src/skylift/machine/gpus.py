"""Data-sheet figures of the GPU models skylift knows: dense peaks and memory bandwidth.

Torch-free facts of the hardware, shared by the catalog, the planner and MFU
(:mod:`skylift.monitor.flops`), so each reads the same numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GPU_TABLE", "GpuIdentity", "GpuSpec", "gpu_spec", "parse_gpu_name", "precision_class"]

_A100_SHEET = "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
_H100_SHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_V100_SHEET = "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"


@dataclass(frozen=True)
class GpuIdentity:
    """What a GPU's name says: its family, its form factor and its memory, each or ``None``."""

    family: str
    """``a100``, ``h100``, ``l40s``...: the model, as one whole word (``l40`` is not ``l4``)."""
    form: str | None = None
    """``sxm``, ``pcie`` or ``nvl``; ``None`` when the name does not say."""
    memory_gb: int | None = None
    """Memory the name states (``80GB``); ``None`` when it does not say."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU variant's data-sheet figures (catalog, planner and MFU read the same)."""

    table_entry: str
    """The variant's name in :data:`GPU_TABLE` (``a100-sxm-80gb``)."""
    peak_tflops: dict[str, float]
    """Dense TFLOP/s per precision class (``half``, ``tf32``, ``fp32``)."""
    memory_bandwidth_bytes_per_s: float
    source: str
    """The NVIDIA data sheet the figures were read in (A10G: AWS)."""
    identity: GpuIdentity | None = None
    memory_gb: float | None = None
    """Device memory of the variant, GB (10^9 bytes)."""

    def peak_flops_per_s(self, precision: str) -> float:
        """Dense peak at ``precision`` (``fp32``, ``tf32``, ``fp16``, ``bf16``), FLOP/s."""
        return self.peak_tflops[precision_class(precision)] * 1e12


def _row(family: str, form: str | None, memory_gb: int, half: float, tf32: float, fp32: float,
         bandwidth_gb_s: float, source: str) -> GpuSpec:  # fmt: skip
    identity = GpuIdentity(family, form, memory_gb)
    entry = "-".join(part for part in (family, form, f"{memory_gb}gb") if part)
    peaks = {"half": half, "tf32": tf32, "fp32": fp32}
    return GpuSpec(entry, peaks, bandwidth_gb_s * 1e9, source, identity, float(memory_gb))


GPU_TABLE: tuple[GpuSpec, ...] = (
    # Dense (no 2:4 sparsity) tensor-core peaks, TFLOP/s: the data sheets print sparse ones
    # for Ampere and later with a footnote; dense is half. ``half`` covers fp16 and bf16 (T4
    # and V100 have no bf16: their fp16 figure is the best case); ``tf32`` is the fp32 figure
    # on GPUs without TensorFloat-32. Bandwidth in GB/s (10^9 bytes/s).
    _row("v100", "sxm", 16, 125.0, 15.7, 15.7, 900.0, _V100_SHEET),
    _row("v100", "sxm", 32, 125.0, 15.7, 15.7, 900.0, _V100_SHEET),
    _row("v100", "pcie", 16, 112.0, 14.0, 14.0, 900.0, _V100_SHEET),
    _row("v100", "pcie", 32, 112.0, 14.0, 14.0, 900.0, _V100_SHEET),
    _row("t4", None, 16, 65.0, 8.1, 8.1, 320.0,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"),
    # A10G: AWS's variant of the A10; NVIDIA publishes no sheet. Its tensor peak (70) is lower
    # than the A10's 125 (cli99/llm-analysis a10g-pcie-24gb.json); the bandwidth is the same.
    _row("a10g", None, 24, 70.0, 35.0, 31.2, 600.0, "https://aws.amazon.com/ec2/instance-types/g5/"),
    _row("a10", None, 24, 125.0, 62.5, 31.2, 600.0,
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf"),
    _row("l4", None, 24, 121.0, 60.0, 30.3, 300.0,
         "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet"),
    _row("l40s", None, 48, 362.05, 183.0, 91.6, 864.0,
         "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    _row("a100", "sxm", 40, 312.0, 156.0, 19.5, 1555.0, _A100_SHEET),
    _row("a100", "sxm", 80, 312.0, 156.0, 19.5, 2039.0, _A100_SHEET),
    _row("a100", "pcie", 40, 312.0, 156.0, 19.5, 1555.0, _A100_SHEET),
    _row("a100", "pcie", 80, 312.0, 156.0, 19.5, 1935.0, _A100_SHEET),
    _row("h100", "sxm", 80, 989.0, 494.7, 66.9, 3350.0, _H100_SHEET),
    _row("h100", "pcie", 80, 756.0, 378.0, 51.2, 2000.0, _H100_SHEET),
    _row("h100", "nvl", 94, 835.5, 417.5, 60.0, 3900.0, _H100_SHEET),
    _row("h200", "sxm", 141, 989.0, 494.7, 66.9, 4800.0,
         "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446"),
)
"""Every GPU variant skylift knows, one row per (family, form factor, memory)."""

_BARE_NAME_VARIANT: dict[str, GpuIdentity] = {
    # A name that states no form factor (the catalog's ``A100``, ``A100-80GB``, ``H100``) means
    # the part the clouds' multi-GPU instances carry: p4d/a2 (A100 40GB SXM4), p5/a3/ND v5 (H100 SXM5), p3 (V100 SXM2).
    "v100": GpuIdentity("v100", "sxm", 16),
    "a100": GpuIdentity("a100", "sxm", 40),
    "h100": GpuIdentity("h100", "sxm", 80),
    "h200": GpuIdentity("h200", "sxm", 141),
}

_FORM_WORDS = {"pcie": "pcie", "nvl": "nvl", "sxm": "sxm", "sxm2": "sxm", "sxm4": "sxm", "sxm5": "sxm",
               "hbm3": "sxm", "hbm3e": "sxm"}  # fmt: skip
"""Driver words that fix the form factor. ``NVIDIA H100 80GB HBM3`` is the SXM5 part (the
PCIe card reports ``NVIDIA H100 PCIe``, its memory being HBM2e)."""

_FAMILIES = {row.identity.family for row in GPU_TABLE if row.identity}


def parse_gpu_name(name: str) -> GpuIdentity | None:
    """The identity in a driver's name (``NVIDIA A100-SXM4-80GB``) or the catalog's (``A100-80GB``).

    Words are split at spaces, dashes and underscores; the family is the first word after
    ``NVIDIA``/``Tesla`` and must be one the table knows, whole. ``None`` for any other name.
    """
    words = [word for word in re.split(r"[\s_\-]+", name.strip().lower()) if word]
    while words and words[0] in ("nvidia", "tesla"):
        words.pop(0)
    if not words or words[0] not in _FAMILIES:
        return None
    form = next((_FORM_WORDS[word] for word in words[1:] if word in _FORM_WORDS), None)
    memory = next((int(match[1]) for word in words[1:] if (match := re.fullmatch(r"(\d+)gb", word))), None)
    return GpuIdentity(words[0], form, memory)


def gpu_spec(name: str) -> GpuSpec | None:
    """The data-sheet figures of the GPU named ``name``, or ``None`` for a GPU not in the table.

    Exact on the parsed identity: every part the name states must match the variant's.
    A name without a form factor means the family's usual one (``_BARE_NAME_VARIANT``:
    ``A100-80GB`` is the SXM4 part, ``A100`` alone the 40GB SXM4); a name that leaves the
    memory open matches when the variants it could be agree on every figure. Anything
    else (``NVIDIA L40``, ``NVIDIA H200 NVL``) is unknown: ``None``, never a near row.

    Example:
        >>> gpu_spec("NVIDIA A100-SXM4-80GB").memory_bandwidth_bytes_per_s
        2039000000000.0
    """
    identity = parse_gpu_name(name)
    if identity is None:
        return None
    usual = _BARE_NAME_VARIANT.get(identity.family)
    if usual is not None and identity.form is None:
        identity = GpuIdentity(identity.family, usual.form, identity.memory_gb or usual.memory_gb)
    candidates = [row for row in GPU_TABLE if row.identity and _matches(row.identity, identity)]
    figures = {(tuple(row.peak_tflops.items()), row.memory_bandwidth_bytes_per_s) for row in candidates}
    return candidates[0] if len(figures) == 1 else None


def _matches(row: GpuIdentity, stated: GpuIdentity) -> bool:
    return (row.family == stated.family and stated.form in (None, row.form)
            and stated.memory_gb in (None, row.memory_gb))  # fmt: skip


def precision_class(precision: str) -> str:
    """``half`` (fp16, bf16), ``tf32`` or ``fp32``: the column of ``GpuSpec.peak_tflops`` a precision reads."""
    return {"fp16": "half", "bf16": "half", "tf32": "tf32"}.get(precision, "fp32")

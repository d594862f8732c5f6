"""NVIDIA's and PyTorch's published compatibility tables, as data.

Each table cites where its numbers come from. Versions are compared as numbers
(``570.124.06 > 570.26``), never as strings.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CUDA_FAMILY_FLOOR",
    "CUDA_RELEASE_MIN_DRIVER",
    "DRIVER_BRANCH_EOL",
    "OLDEST_LISTED_BRANCH",
    "TORCH_LOAD_CVE_FIXED",
    "WHEEL_VARIANTS",
    "WheelVariant",
    "family_floor",
    "release_min_driver",
    "version_tuple",
    "wheels_with_capability",
]

# Minimum Linux driver of each CUDA toolkit release ("Toolkit Driver Version" in
# https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html, as mirrored in
# meson's _DRIVER_TABLE_VERSION: https://github.com/mesonbuild/meson/blob/master/mesonbuild/modules/cuda.py).
CUDA_RELEASE_MIN_DRIVER: dict[str, str] = {
    "13.3.0": "610.43.02",
    "13.3.1": "610.43.02",
    "13.2.0": "595.45.04",
    "13.2.1": "595.58.03",
    "13.1.0": "590.44.01",
    "13.1.1": "590.48.01",
    "13.0.0": "580.65.06",
    "13.0.1": "580.82.07",
    "13.0.2": "580.95.05",
    "12.9.0": "575.51.03",
    "12.9.1": "575.57.08",
    "12.8.0": "570.26",
    "12.8.1": "570.124.06",
    "12.6.0": "560.28.03",
    "12.6.1": "560.35.03",
    "12.6.2": "560.35.03",
    "12.6.3": "560.35.05",
    "12.5.0": "555.42.02",
    "12.5.1": "555.42.06",
    "12.4.0": "550.54.14",
    "12.4.1": "550.54.15",
    "12.3.0": "545.23.06",
    "12.3.1": "545.23.08",
    "12.2.0": "535.54.03",
    "12.2.1": "535.86.09",
    "12.2.2": "535.104.05",
    "12.1.0": "530.30.02",
    "12.1.1": "530.30.02",
    "12.0.0": "525.60.13",
    "12.0.1": "525.85.11",
    "11.8.0": "520.61.05",
    "11.7.0": "515.43.04",
    "11.7.1": "515.48.07",
}

# Minor-version compatibility: any toolkit of a major family runs, with a limited
# feature set (no PTX JIT of newer PTX), on a driver at least this new.
# https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html;
# exact floors quoted from the release notes in https://github.com/ComputeCanada/software-stack-config/pull/59.
CUDA_FAMILY_FLOOR: dict[int, str] = {13: "580.65.06", 12: "525.60.13", 11: "450.80.02"}

# Datacenter driver branches and their end of life (last month of support), from
# https://docs.nvidia.com/datacenter/tesla/drivers/supported-drivers-and-cuda-toolkit-versions.html.
DRIVER_BRANCH_EOL: dict[int, str] = {535: "2026-06", 570: "2026-02", 580: "2028-08"}
OLDEST_LISTED_BRANCH = min(DRIVER_BRANCH_EOL)
"""Branches older than this one are off NVIDIA's list of supported branches."""

# CVE-2025-32434 (GHSA-53q9-r3pm-6pq6): torch.load with weights_only=True could still run
# code; fixed in 2.6.0 with no backport.
# https://github.com/pytorch/pytorch/security/advisories/GHSA-53q9-r3pm-6pq6
TORCH_LOAD_CVE_FIXED = "2.6.0"


@dataclass(frozen=True)
class WheelVariant:
    """One CUDA variant of the Linux x86-64 torch wheels of some releases."""

    torch_from: str
    torch_to: str
    """Inclusive minor-release range, e.g. 2.10 to 2.11."""
    variant: str
    capabilities: tuple[tuple[int, int], ...]

    @property
    def index_url(self) -> str:
        return f"https://download.pytorch.org/whl/{self.variant}"


_LEGACY = ((5, 0), (6, 0), (7, 0), (7, 5), (8, 0), (8, 6), (9, 0))
_VOLTA_TO_BLACKWELL = ((7, 0), (7, 5), (8, 0), (8, 6), (9, 0), (10, 0), (12, 0))
_TURING_TO_BLACKWELL = _VOLTA_TO_BLACKWELL[1:]

# Sources: 2.8 https://github.com/pytorch/pytorch/issues/157517; 2.9
# https://github.com/pytorch/pytorch/pull/164471; 2.10-2.11
# https://github.com/pytorch/pytorch/issues/172352, .../issues/172663; 2.12-2.14
# https://github.com/pytorch/pytorch/pull/182849 (cu128 removed; cu132's arch list is
# not in these sources, so it is not offered here).
WHEEL_VARIANTS: tuple[WheelVariant, ...] = (
    WheelVariant("2.8", "2.8", "cu126", _LEGACY),
    WheelVariant("2.8", "2.8", "cu128", _VOLTA_TO_BLACKWELL),
    WheelVariant("2.8", "2.8", "cu129", _VOLTA_TO_BLACKWELL),
    WheelVariant("2.9", "2.9", "cu126", _LEGACY),
    WheelVariant("2.9", "2.9", "cu128", _VOLTA_TO_BLACKWELL),
    WheelVariant("2.9", "2.9", "cu130", _TURING_TO_BLACKWELL),
    WheelVariant("2.10", "2.11", "cu126", _LEGACY),
    WheelVariant("2.10", "2.11", "cu128", _TURING_TO_BLACKWELL),
    WheelVariant("2.10", "2.11", "cu130", _TURING_TO_BLACKWELL),
    WheelVariant("2.12", "2.14", "cu126", _LEGACY),
    WheelVariant("2.12", "2.14", "cu130", _TURING_TO_BLACKWELL),
)


def version_tuple(text: str) -> tuple[int, ...]:
    """``'570.124.06'`` -> ``(570, 124, 6)``; a non-numeric tail ends the tuple."""
    numbers: list[int] = []
    for part in text.strip().split("."):
        digits = "".join(character for character in part if character.isdigit())
        if not digits or not part[0].isdigit():
            break
        numbers.append(int(digits))
    return tuple(numbers)


def release_min_driver(cuda: str) -> str | None:
    """The lowest driver of any ``cuda`` (``'12.8'``) release: torch reports only
    major.minor, so the ``.0`` row is the requirement that is certain."""
    rows = [driver for release, driver in CUDA_RELEASE_MIN_DRIVER.items() if release.startswith(f"{cuda}.")]
    return min(rows, key=version_tuple) if rows else None


def family_floor(cuda: str) -> str | None:
    """The minor-version-compatibility floor of ``cuda``'s major family."""
    major = version_tuple(cuda)[:1]
    return CUDA_FAMILY_FLOOR.get(major[0]) if major else None


def wheels_with_capability(torch_version: str, capability: tuple[int, int]) -> list[WheelVariant]:
    """Wheel variants of ``torch_version``'s release (or the newest listed before it)
    with kernels that run on ``capability``: same major, minor at most the GPU's."""
    release = version_tuple(torch_version)[:2]
    listed = [v for v in WHEEL_VARIANTS if version_tuple(v.torch_from) <= release]
    if not listed:
        return []
    newest_from = max(version_tuple(v.torch_from) for v in listed)
    current = [v for v in listed if version_tuple(v.torch_from) == newest_from]
    return [v for v in current if any(c[0] == capability[0] and c[1] <= capability[1] for c in v.capabilities)]

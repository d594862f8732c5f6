"""Torch's build and the NVIDIA driver, GPUs and GPU-to-GPU links, read through NVML.

NVML (``nvidia-ml-py``) is a library call, not the ``nvidia-smi`` program, so this
works in images without it and costs milliseconds. Each query may be unsupported on a
given GPU (ECC on consumer cards, PCIe on some VMs): it is then ``None``, not an error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from skylift.machine.facts import DriverFacts, GpuFacts, GpuLinkFacts, TorchFacts

__all__ = ["gather_gpus", "gather_torch"]

# NVML's nvmlGpuTopologyLevel_t in the notation of ``nvidia-smi topo -m``.
_TOPOLOGY_PATHS = {0: "BOARD", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def gather_torch() -> TorchFacts:
    """Version and build of the installed torch; imports it (about two seconds)."""
    try:
        import torch
    except ImportError as error:
        return TorchFacts(installed=False, error=f"torch is not importable: {error}")
    facts = TorchFacts(version=torch.__version__, cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None))
    facts.arch_list = _arch_list(torch)
    facts.cudnn = _quietly(torch.backends.cudnn.version)
    nccl = _quietly(torch.cuda.nccl.version) if facts.cuda else None
    facts.nccl = ".".join(str(part) for part in nccl) if isinstance(nccl, tuple) else None
    facts.cuda_available = bool(_quietly(torch.cuda.is_available))
    facts.device_count = int(_quietly(torch.cuda.device_count) or 0) if facts.cuda_available else 0
    return facts


def _arch_list(torch: Any) -> list[str]:
    listed = _quietly(torch.cuda.get_arch_list) or []
    if listed or not torch.version.cuda:
        return list(listed)
    # get_arch_list() answers [] when no GPU is visible in some releases; the compiled
    # flags it reads are known without one.
    flags = _quietly(getattr(torch._C, "_cuda_getArchFlags", lambda: None))
    return flags.split() if isinstance(flags, str) else []


def gather_gpus() -> tuple[DriverFacts, list[GpuFacts], list[GpuLinkFacts]]:
    """The driver, each GPU and each pair's link; without NVML, the reason why."""
    from skylift.monitor.nvml import Nvml

    session = Nvml()
    if not session.available:
        return DriverFacts(nvml=False, reason=session.reason), [], []
    try:
        import pynvml

        handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(pynvml.nvmlDeviceGetCount())]
        driver = DriverFacts(
            nvml=True,
            version=_text(_query(pynvml.nvmlSystemGetDriverVersion)),
            cuda=_cuda_text(_query(pynvml.nvmlSystemGetCudaDriverVersion)),
        )
        gpus = [_gpu(pynvml, index, handle) for index, handle in enumerate(handles)]
        links = [_link(pynvml, a, b, handles) for a, b in itertools.combinations(range(len(handles)), 2)]
    finally:
        session.close()
    return driver, gpus, links


def _gpu(nvml: Any, index: int, handle: Any) -> GpuFacts:
    memory = _query(nvml.nvmlDeviceGetMemoryInfo, handle)
    ecc = _query(nvml.nvmlDeviceGetEccMode, handle)
    mig = _query(nvml.nvmlDeviceGetMigMode, handle)
    pci = _query(nvml.nvmlDeviceGetPciInfo, handle)
    capability = _query(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    return GpuFacts(
        index=index,
        name=_text(_query(nvml.nvmlDeviceGetName, handle)) or "unknown",
        capability=tuple(capability) if capability else None,
        memory_total_bytes=getattr(memory, "total", None),
        ecc_enabled=bool(ecc[0]) if ecc else None,
        mig_enabled=bool(mig[0]) if mig else None,
        pcie_generation=_query(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        pcie_width=_query(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        pcie_max_generation=_query(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        pcie_max_width=_query(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        nvlinks_active=_active_nvlinks(nvml, handle),
        bus_id=_text(getattr(pci, "busId", None)),
    )


def _active_nvlinks(nvml: Any, handle: Any) -> int | None:
    states = [_query(nvml.nvmlDeviceGetNvLinkState, handle, link) for link in range(nvml.NVML_NVLINK_MAX_LINKS)]
    known = [state for state in states if state is not None]
    return sum(1 for state in known if state == nvml.NVML_FEATURE_ENABLED) if known else None


def _link(nvml: Any, a: int, b: int, handles: list[Any]) -> GpuLinkFacts:
    level = _query(nvml.nvmlDeviceGetTopologyCommonAncestor, handles[a], handles[b])
    nvlink = _query(nvml.nvmlDeviceGetP2PStatus, handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    read = _query(nvml.nvmlDeviceGetP2PStatus, handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_READ)
    on_nvlink = nvlink == nvml.NVML_P2P_STATUS_OK
    return GpuLinkFacts(
        gpu_a=a,
        gpu_b=b,
        nvlink=on_nvlink,
        path="NV" if on_nvlink else _TOPOLOGY_PATHS.get(level) if level is not None else None,
        p2p_read=None if read is None else read == nvml.NVML_P2P_STATUS_OK,
    )


def _query(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, or None when NVML says the query is unsupported or failed."""
    import pynvml

    try:
        return function(*args)
    except pynvml.NVMLError:
        return None


def _quietly(function: Callable[[], Any]) -> Any:
    try:
        return function()
    except (RuntimeError, AttributeError, OSError):  # a build without the library
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_text(encoded: int | None) -> str | None:
    """NVML's CUDA version integer, 12080, as '12.8'."""
    if not encoded:
        return None
    return f"{encoded // 1000}.{encoded % 1000 // 10}"

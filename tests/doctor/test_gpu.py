"""GPU facts through NVML, against a stand-in ``pynvml`` (this machine has no driver)."""

from __future__ import annotations

import sys
import types

import pytest

from skylift.doctor.gpu import gather_gpus


class _NVMLError(Exception):
    pass


def _fake_pynvml() -> types.ModuleType:
    """Two NVLinked H100s on driver 580.95.05; ECC is a query this 'GPU' does not support."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = _NVMLError
    nvml.NVML_NVLINK_MAX_LINKS, nvml.NVML_FEATURE_ENABLED = 4, 1
    nvml.NVML_P2P_CAPS_INDEX_READ, nvml.NVML_P2P_CAPS_INDEX_NVLINK, nvml.NVML_P2P_STATUS_OK = 0, 3, 0

    def unsupported(*args: object) -> None:
        raise _NVMLError("Not Supported")

    functions = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 2,
        "nvmlDeviceGetHandleByIndex": lambda index: f"gpu{index}",
        "nvmlSystemGetDriverVersion": lambda: b"580.95.05",
        "nvmlSystemGetCudaDriverVersion": lambda: 13000,
        "nvmlDeviceGetName": lambda handle: "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetCudaComputeCapability": lambda handle: (9, 0),
        "nvmlDeviceGetMemoryInfo": lambda handle: types.SimpleNamespace(total=85520809984),
        "nvmlDeviceGetEccMode": unsupported,
        "nvmlDeviceGetMigMode": lambda handle: (0, 0),
        "nvmlDeviceGetPciInfo": lambda handle: types.SimpleNamespace(busId=f"00000000:{handle[-1]}8:00.0".encode()),
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda handle: 5,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda handle: 16,
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda handle: 5,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda handle: 16,
        "nvmlDeviceGetNvLinkState": lambda handle, link: 1 if link < 3 else unsupported(),
        "nvmlDeviceGetTopologyCommonAncestor": lambda a, b: 50,
        "nvmlDeviceGetP2PStatus": lambda a, b, index: 0,
    }
    for name, function in functions.items():
        setattr(nvml, name, function)
    return nvml


def test_gpus_links_and_driver_from_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml())
    driver, gpus, links = gather_gpus()
    assert (driver.nvml, driver.version, driver.cuda) == (True, "580.95.05", "13.0")
    assert [gpu.index for gpu in gpus] == [0, 1]
    gpu = gpus[0]
    assert (gpu.capability, gpu.memory_total_bytes, gpu.mig_enabled) == ((9, 0), 85520809984, False)
    assert gpu.ecc_enabled is None  # unsupported queries are unknown, not errors
    assert (gpu.pcie_generation, gpu.pcie_width, gpu.nvlinks_active, gpu.bus_id) == (5, 16, 3, "00000000:08:00.0")
    assert [(link.gpu_a, link.gpu_b, link.path, link.nvlink, link.p2p_read) for link in links] == [
        (0, 1, "NV", True, True)
    ]


def test_without_nvml_the_reason_is_kept(monkeypatch):
    fake = _fake_pynvml()

    def no_library() -> None:
        raise _NVMLError("NVML Shared Library Not Found")

    fake.nvmlInit = no_library
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    driver, gpus, links = gather_gpus()
    assert driver.nvml is False and "NVML Shared Library Not Found" in driver.reason
    assert gpus == [] and links == []


@pytest.mark.parametrize("level, path", [(10, "PIX"), (30, "PHB"), (50, "SYS")])
def test_pcie_paths_use_nvidia_smi_names(monkeypatch, level, path):
    fake = _fake_pynvml()
    fake.nvmlDeviceGetTopologyCommonAncestor = lambda a, b: level
    fake.nvmlDeviceGetP2PStatus = lambda a, b, index: 0 if index == fake.NVML_P2P_CAPS_INDEX_READ else 5
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    link = gather_gpus()[2][0]
    assert (link.path, link.nvlink, link.p2p_read) == (path, False, True)

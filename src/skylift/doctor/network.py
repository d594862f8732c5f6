"""Network facts NCCL depends on: interfaces, RDMA devices, net plugins, nccl.conf.

RDMA devices are read from sysfs (``/sys/class/infiniband``), where InfiniBand,
RoCE, AWS EFA and Alibaba eRDMA adapters all appear; the kernel driver behind each
tells them apart. ``sys_root`` and the folder arguments exist so tests can point
them at a fake tree.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from skylift.doctor.system import read_text
from skylift.machine.facts import InterfaceFacts, NetPluginFacts, NetworkFacts, RdmaDeviceFacts, RdmaKind

__all__ = ["KNOWN_PLUGIN_FOLDERS", "gather_network", "read_nccl_conf"]

# Where vendor images install NCCL net plugins without always putting them on the
# loader's path: aws-ofi-nccl (https://github.com/NVIDIA-NeMo/RL/pull/2359,
# https://github.com/dstackai/dstack/issues/3069), GCP GPUDirect-TCPX/TCPXO
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpu-bandwidth-gpudirect-tcpx).
KNOWN_PLUGIN_FOLDERS = (
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/aws-ofi-nccl/lib",
    "/opt/amazon/efa/lib",
    "/opt/aws-ofi-nccl/lib",
    "/usr/local/tcpx/lib64",
    "/var/lib/tcpxo/lib64",
)
_SYSTEM_LIBRARY_FOLDERS = (
    "/lib",
    "/usr/lib",
    "/lib64",
    "/usr/lib64",
    "/usr/local/lib",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
)
_DRIVER_KINDS: dict[str, RdmaKind] = {"efa": "efa", "erdma": "erdma"}


def gather_network(
    environ: dict[str, str], *, sys_root: str = "/", ld_conf_dir: str = "/etc/ld.so.conf.d"
) -> NetworkFacts:
    """Interfaces (psutil), RDMA devices (sysfs) and the NCCL net plugins found."""
    return NetworkFacts(
        interfaces=_interfaces(),
        rdma_devices=_rdma_devices(Path(sys_root) / "sys/class/infiniband"),
        nccl_net_plugins=_net_plugins(environ, ld_conf_dir),
    )


def _interfaces() -> list[InterfaceFacts]:
    import psutil

    found = []
    for name, stats in sorted(psutil.net_if_stats().items()):
        found.append(
            InterfaceFacts(
                name=name,
                up=stats.isup,
                loopback="loopback" in stats.flags or name in ("lo", "lo0"),
                mtu=stats.mtu or None,
                speed_mbps=stats.speed or None,
            )
        )
    return found


def _rdma_devices(folder: Path) -> list[RdmaDeviceFacts]:
    if not folder.is_dir():
        return []
    return [_rdma_device(path) for path in sorted(folder.iterdir())]


def _rdma_device(path: Path) -> RdmaDeviceFacts:
    driver_link = path / "device" / "driver"
    driver = os.path.basename(os.path.realpath(driver_link)) if driver_link.exists() else None
    ports = sorted((path / "ports").glob("*")) if (path / "ports").is_dir() else []
    link_layer = read_text(ports[0] / "link_layer") if ports else None
    state = read_text(ports[0] / "state") if ports else None  # "4: ACTIVE"
    kind = _DRIVER_KINDS.get(driver or "")
    if kind is None:
        by_link_layer: dict[str, RdmaKind] = {"InfiniBand": "ib", "Ethernet": "roce"}
        kind = by_link_layer.get(link_layer or "", "other")
    return RdmaDeviceFacts(
        name=path.name,
        kind=kind,
        driver=driver,
        link_layer=link_layer,
        state=state.split(":", 1)[-1].strip() if state else None,
    )


def _net_plugins(environ: dict[str, str], ld_conf_dir: str) -> list[NetPluginFacts]:
    searched = _loader_folders(environ, ld_conf_dir)
    found: dict[str, bool] = {}
    for folder in [*searched, *KNOWN_PLUGIN_FOLDERS]:
        for path in sorted(glob.glob(os.path.join(folder, "libnccl-net*.so*"))):
            found.setdefault(path, folder in searched)
    explicit = environ.get("NCCL_NET_PLUGIN", "")
    if os.path.isabs(explicit) and os.path.isfile(explicit):
        found[explicit] = True  # NCCL dlopens an absolute NCCL_NET_PLUGIN directly
    return [NetPluginFacts(path=path, on_search_path=on_path) for path, on_path in found.items()]


def _loader_folders(environ: dict[str, str], ld_conf_dir: str) -> list[str]:
    """Folders ``dlopen`` searches: LD_LIBRARY_PATH, the ld.so.conf.d entries, the system's."""
    folders = [part for part in environ.get("LD_LIBRARY_PATH", "").split(":") if part]
    for conf in sorted(glob.glob(os.path.join(ld_conf_dir, "*.conf"))):
        lines = (read_text(Path(conf)) or "").splitlines()
        folders += [line.strip() for line in lines if line.strip().startswith("/")]
    return [os.path.normpath(folder) for folder in [*folders, *_SYSTEM_LIBRARY_FOLDERS]]


def read_nccl_conf(paths: list[Path]) -> dict[str, str]:
    """``KEY=VALUE`` lines of NCCL's configuration files (later files win, as in NCCL)."""
    settings: dict[str, str] = {}
    for path in paths:
        for line in (read_text(path) or "").splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() and not key.lstrip().startswith("#"):
                settings[key.strip()] = value.strip()
    return settings

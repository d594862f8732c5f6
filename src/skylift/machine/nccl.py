"""The NCCL settings a machine needs, decided from its facts and never over the user's.

:func:`plan_nccl` returns what ``skylift run``/``launch`` put in the workers'
environment, each with the reason, and what it left alone because the user (or
/etc/nccl.conf) already set it. The plan travels to the workers as the JSON variable
``SKYLIFT_NCCL_SETTINGS`` (see :meth:`NcclPlan.record`), for the ``run_start`` record.

Sources: NCCL's variables https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html;
PyTorch's https://pytorch.org/docs/stable/torch_nccl_environment_variables.html; the
cloud presets are cited where they are set.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from skylift.machine.facts import Facts, InterfaceFacts

__all__ = [
    "AZURE_NDV5_TOPOLOGY_FILE",
    "SETTINGS_VARIABLE",
    "NcclPlan",
    "NcclSetting",
    "candidate_interface",
    "is_azure_ndv5",
    "plan_nccl",
    "recorded_settings",
    "route_interface",
    "selected_interfaces",
    "uses_nccl",
]

SETTINGS_VARIABLE = "SKYLIFT_NCCL_SETTINGS"
AZURE_NDV5_TOPOLOGY_FILE = "/opt/microsoft/ndv5-topo.xml"
"""Shipped by Azure's HPC images (https://github.com/Azure/azhpc-images/blob/master/topology/ndv5-topo.xml)."""

# Interfaces NCCL should not carry traffic over: container bridges, overlays, tunnels.
_VIRTUAL_PREFIXES = (
    "lo",
    "docker",
    "veth",
    "virbr",
    "br-",
    "cni",
    "flannel",
    "cali",
    "tunl",
    "vxlan",
    "kube",
    "ifb",
    "dummy",
    "tailscale",
    "wg",
    "zt",
)
# EFA instances with GPUDirect RDMA (FI_EFA_USE_DEVICE_RDMA=1 is for p4d and newer:
# https://github.com/aws/sagemaker-training-toolkit/commit/9a5ed9fe4fef4e5858a47c5e6948fa9822bdfcac).
_EFA_RDMA_INSTANCE = re.compile(r"^(p4d|p4de|p5|p5e|p5en|p6[a-z0-9-]*)\.")
_AZURE_NDV5 = re.compile(r"^Standard_ND\d+\w*_H(100|200)_v5$", re.IGNORECASE)


@dataclass(frozen=True)
class NcclSetting:
    name: str
    value: str
    reason: str


@dataclass
class NcclPlan:
    """Variables to set (``chosen``) and the user's values left in place (``kept``)."""

    chosen: list[NcclSetting] = field(default_factory=list)
    kept: list[NcclSetting] = field(default_factory=list)
    note: str = ""

    def propose(self, facts: Facts, name: str, value: str, reason: str) -> None:
        """Set ``name`` unless the environment or nccl.conf already does."""
        current = facts.nccl_setting(name)
        if current is None:
            self.chosen.append(NcclSetting(name, value, reason))
        elif current != value:
            self.kept.append(NcclSetting(name, current, f"set by the user; skylift would set {value}: {reason}"))

    def record(self) -> dict[str, object]:
        """What ``SKYLIFT_NCCL_SETTINGS`` holds: ``{"set": [...], "kept": [...], "note"}``."""

        def rows(settings: list[NcclSetting]) -> list[dict[str, str]]:
            return [{"name": s.name, "value": s.value, "reason": s.reason} for s in settings]

        return {"set": rows(self.chosen), "kept": rows(self.kept), "note": self.note}

    def environment(self) -> dict[str, str]:
        """The variables for the workers, the JSON record among them."""
        values = {setting.name: setting.value for setting in self.chosen}
        return {**values, SETTINGS_VARIABLE: json.dumps(self.record(), separators=(",", ":"))}

    def lines(self) -> list[str]:
        """One line per decision, for the launcher to print."""
        chosen = [f"set {s.name}={s.value}: {s.reason}" for s in self.chosen]
        return chosen + [f"kept {s.name}={s.value} ({s.reason})" for s in self.kept]


def recorded_settings(environ: Mapping[str, str] | None = None) -> dict[str, object] | None:
    """The plan a worker was started with (for its ``run_start`` record); None when the
    worker was not started by ``skylift run``/``launch`` or the variable is unreadable."""
    text = (os.environ if environ is None else environ).get(SETTINGS_VARIABLE)
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def uses_nccl(facts: Facts, world_size: int) -> bool:
    """Several processes on visible CUDA GPUs with the backend left to ``auto`` or ``nccl``."""
    job = facts.job
    if job is not None and (job.backend == "gloo" or job.device == "cpu"):
        return False
    return world_size > 1 and facts.torch.cuda_available and bool(facts.torch.cuda)


def plan_nccl(facts: Facts, *, world_size: int, nnodes: int, master_addr: str | None = None) -> NcclPlan:
    """What this machine's workers need; empty (with a note) when NCCL is not used."""
    plan = NcclPlan()
    if not uses_nccl(facts, world_size):
        plan.note = "NCCL not used: a single process, no CUDA GPU, or the gloo backend"
        return plan
    plan.propose(
        facts,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "1",
        "abort the communicator and end the process on a failed or timed-out collective, so "
        "torchrun stops the job instead of leaving it hung",
    )
    plan.propose(
        facts,
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "1",
        "a timed-out collective leaves a flight-recorder dump per rank naming the stalled collective",
    )
    plan.propose(facts, "TORCH_NCCL_TRACE_BUFFER_SIZE", "2000", "the dump needs a trace buffer above 0")
    if nnodes > 1:
        _socket_interface(plan, facts, master_addr)
    _efa(plan, facts)
    _azure_ndv5(plan, facts)
    _p2p_level(plan, facts)
    return plan


def _socket_interface(plan: NcclPlan, facts: Facts, master_addr: str | None) -> None:
    interface = route_interface(master_addr) if master_addr else None
    reason = f"the interface that routes to --master-addr {master_addr}"
    if interface is None:
        interface, reason = candidate_interface(facts.network.interfaces), "the first physical interface that is up"
    if interface:
        # A plain prefix, not "=name": some older NCCL builds do not parse "=".
        plan.propose(
            facts, "NCCL_SOCKET_IFNAME", interface, f"{reason}; NCCL could otherwise bootstrap over a container bridge"
        )


def _efa(plan: NcclPlan, facts: Facts) -> None:
    if not any(device.kind == "efa" for device in facts.network.rdma_devices):
        return
    off_path = [plugin.path for plugin in facts.network.nccl_net_plugins if not plugin.on_search_path]
    if off_path and not any(plugin.on_search_path for plugin in facts.network.nccl_net_plugins):
        folder = off_path[0].rsplit("/", 1)[0]
        current = facts.environment.get("LD_LIBRARY_PATH", "")
        plan.chosen.append(
            NcclSetting(
                "LD_LIBRARY_PATH",
                f"{folder}:{current}".rstrip(":"),
                f"prepended {folder}: NCCL finds the aws-ofi-nccl plugin there and uses "
                "EFA instead of falling back to sockets",
            )
        )
    # FI_PROVIDER=efa keeps libfabric from picking a slower provider (e.g.
    # https://gist.github.com/nousr/5dd641a34cb5976f9cde0501af4519fe).
    plan.propose(facts, "FI_PROVIDER", "efa", "use libfabric's EFA provider")
    if _EFA_RDMA_INSTANCE.match(facts.cloud.instance_type or ""):
        plan.propose(facts, "FI_EFA_USE_DEVICE_RDMA", "1", f"{facts.cloud.instance_type} has GPUDirect RDMA over EFA")


def is_azure_ndv5(facts: Facts) -> bool:
    """An Azure ND H100/H200 v5 VM, by instance type (or, without it, 8 H100/H200 and InfiniBand)."""
    if facts.cloud.name != "azure":
        return False
    if facts.cloud.instance_type:
        return bool(_AZURE_NDV5.match(facts.cloud.instance_type))
    hopper = [gpu for gpu in facts.gpus if "H100" in gpu.name or "H200" in gpu.name]
    return len(hopper) == 8 and any(device.kind == "ib" for device in facts.network.rdma_devices)


def _azure_ndv5(plan: NcclPlan, facts: Facts) -> None:
    # https://github.com/Azure/azhpc-images/blob/master/topology/ndv5-topo.xml and
    # https://jingchaozhang.github.io/Decoding-Azure-NCCL-Topology-Files/
    if not is_azure_ndv5(facts):
        return
    if facts.files.get(AZURE_NDV5_TOPOLOGY_FILE):
        plan.propose(
            facts,
            "NCCL_TOPO_FILE",
            AZURE_NDV5_TOPOLOGY_FILE,
            "ND v5's virtual PCI topology hides which GPU sits next to which NIC",
        )
    plan.propose(facts, "NCCL_IB_PCI_RELAXED_ORDERING", "1", "Azure's setting for ND v5 InfiniBand")
    plan.propose(facts, "CUDA_DEVICE_ORDER", "PCI_BUS_ID", "GPU numbers match the topology file's PCI order")


def _p2p_level(plan: NcclPlan, facts: Facts) -> None:
    blocked = [link for link in facts.gpu_links if link.p2p_read is False and not link.nvlink]
    if blocked and any(link.nvlink for link in facts.gpu_links):
        pair = f"GPU {blocked[0].gpu_a} and GPU {blocked[0].gpu_b}"
        plan.propose(
            facts,
            "NCCL_P2P_LEVEL",
            "NVL",
            f"the driver reports no PCIe peer access between {pair}: peer-to-peer over NVLink only",
        )


def selected_interfaces(value: str, names: list[str]) -> list[str]:
    """The interfaces ``NCCL_SOCKET_IFNAME=value`` selects: comma-separated prefixes,
    ``=`` for exact names, a leading ``^`` to exclude."""
    exclude = value.startswith("^")
    body = value[1:] if exclude else value
    exact = body.startswith("=")
    patterns = [part.strip() for part in (body[1:] if exact else body).split(",") if part.strip()]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    return [name for name in names if hit(name) != exclude]


def candidate_interface(interfaces: list[InterfaceFacts]) -> str | None:
    """The interface NCCL should use: up, physical, InfiniBand (``ib*``) first."""
    usable = [i.name for i in interfaces if i.up and not i.loopback and not i.name.startswith(_VIRTUAL_PREFIXES)]
    infiniband = [name for name in usable if name.startswith("ib")]
    preferred = infiniband or usable
    return preferred[0] if preferred else None


def route_interface(address: str) -> str | None:
    """The local interface whose address routes to ``address``. A UDP ``connect`` only
    asks the kernel for the route; no packet is sent."""
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.address == local for entry in addresses):
            return name
    return None

"""NCCL's settings against this machine's network: interface, IB, EFA, topology, eRDMA.

Variables may come from the environment or from /etc/nccl.conf; both are read
through :meth:`Facts.nccl_setting`. Sources: NCCL's variables
(https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) and the cloud
notes cited per rule.
"""

from __future__ import annotations

from skylift.doctor.tables import version_tuple
from skylift.doctor.verdicts import Finding, Status, rule
from skylift.machine.facts import Facts
from skylift.machine.nccl import (
    AZURE_NDV5_TOPOLOGY_FILE,
    candidate_interface,
    is_azure_ndv5,
    selected_interfaces,
    uses_nccl,
)

__all__ = [
    "azure_ndv5_has_topology",
    "efa_has_plugin",
    "erdma_nccl_is_new_enough",
    "ib_is_enabled",
    "socket_ifname_exists",
]

ERDMA_MIN_NCCL = "2.19"
"""eRDMA needs NCCL 2.19 or newer
(https://www.alibabacloud.com/help/en/pai/user-guide/erdma-distributed-training-with-high-performance-networks)."""


def _job_uses_nccl(facts: Facts) -> bool:
    """Without a job (plain ``skylift doctor``) every NCCL rule reports."""
    job = facts.job
    return job is None or uses_nccl(facts, job.nproc * job.nnodes)


@rule("nccl-socket-ifname", gate=True)
def socket_ifname_exists(facts: Facts) -> Finding | None:
    """``NCCL_SOCKET_IFNAME`` selects at least one interface of this machine."""
    value = facts.nccl_setting("NCCL_SOCKET_IFNAME")
    if value is None or not _job_uses_nccl(facts):
        return None
    names = [interface.name for interface in facts.network.interfaces]
    chosen = selected_interfaces(value, names)
    if chosen:
        return Finding("pass", f"NCCL_SOCKET_IFNAME={value} selects {', '.join(chosen)}")
    suggestion = candidate_interface(facts.network.interfaces)
    fix = f"export NCCL_SOCKET_IFNAME={suggestion}" if suggestion else "unset NCCL_SOCKET_IFNAME"
    return Finding(
        "fail",
        f"NCCL_SOCKET_IFNAME={value} names no interface here (have: {', '.join(names) or 'none'}): NCCL stops "
        'with "no socket interface found" or bootstraps nowhere',
        f"{fix} (or unset it and let NCCL choose)",
    )


@rule("nccl-ib")
def ib_is_enabled(facts: Facts) -> Finding | None:
    """``NCCL_IB_DISABLE=1`` on a machine with an active InfiniBand/RoCE port."""
    active = [d.name for d in facts.network.rdma_devices if d.kind in ("ib", "roce") and d.state == "ACTIVE"]
    if not active:
        return None
    if facts.nccl_setting("NCCL_IB_DISABLE") == "1":
        return Finding(
            "warn",
            f"NCCL_IB_DISABLE=1 although {', '.join(active)} are active: NCCL uses TCP sockets, "
            "several times slower between nodes",
            "unset NCCL_IB_DISABLE",
        )
    return Finding("pass", f"InfiniBand/RoCE devices active and enabled for NCCL: {', '.join(active)}")


@rule("nccl-efa", gate=True)
def efa_has_plugin(facts: Facts) -> Finding | None:
    """EFA devices need the aws-ofi-nccl plugin on the loader path, else NCCL uses sockets."""
    efa = [device.name for device in facts.network.rdma_devices if device.kind == "efa"]
    if not efa:
        return None
    plugins = facts.network.nccl_net_plugins
    loadable = [plugin.path for plugin in plugins if plugin.on_search_path]
    if loadable:
        return Finding("pass", f"EFA devices ({', '.join(efa)}) and the NCCL net plugin {loadable[0]}")
    multi_node = facts.job is not None and facts.job.nnodes > 1
    status: Status = "fail" if multi_node else "warn"
    reason = (
        f"EFA devices ({', '.join(efa)}) but no NCCL net plugin on the loader path: NCCL falls back to "
        'TCP sockets (no "Using network AWS Libfabric" in the NCCL_DEBUG=INFO log)'
    )
    if plugins:
        folder = plugins[0].path.rsplit("/", 1)[0]
        return Finding(status, reason, f"export LD_LIBRARY_PATH={folder}:$LD_LIBRARY_PATH (skylift run does this)")
    return Finding(
        status,
        reason,
        "install aws-ofi-nccl (the EFA installer and AWS Deep Learning AMIs ship it "
        "in /opt/amazon/ofi-nccl) or use an EFA-enabled image",
    )


@rule("nccl-topology", gate=True)
def azure_ndv5_has_topology(facts: Facts) -> Finding | None:
    """Azure ND H100/H200 v5 needs ``NCCL_TOPO_FILE``; Marketplace images lack it."""
    if not is_azure_ndv5(facts):
        return None
    value = facts.nccl_setting("NCCL_TOPO_FILE")
    if value and facts.files.get(value):
        return Finding("pass", f"Azure ND v5 with NCCL_TOPO_FILE={value}")
    if value:
        return Finding(
            "fail", f"NCCL_TOPO_FILE={value} does not exist", f"export NCCL_TOPO_FILE={AZURE_NDV5_TOPOLOGY_FILE}"
        )
    shipped = facts.files.get(AZURE_NDV5_TOPOLOGY_FILE, False)
    fix = f"export NCCL_TOPO_FILE={AZURE_NDV5_TOPOLOGY_FILE}"
    if shipped:
        fix += " (the file is there; skylift run sets it)"
    else:
        fix = (
            "download https://github.com/Azure/azhpc-images/blob/master/topology/ndv5-topo.xml to "
            f"{AZURE_NDV5_TOPOLOGY_FILE}, then {fix}"
        )
    return Finding(
        "warn",
        f"Azure ND v5 ({facts.cloud.instance_type or '8 x H100/H200 with InfiniBand'}) without "
        "NCCL_TOPO_FILE: NCCL guesses the GPU-NIC topology wrong and runs slower (about 20 % in one "
        "report)",
        fix,
    )


@rule("nccl-erdma", gate=True)
def erdma_nccl_is_new_enough(facts: Facts) -> Finding | None:
    """Alibaba eRDMA works with NCCL 2.19 and newer only."""
    erdma = [device.name for device in facts.network.rdma_devices if device.kind == "erdma"]
    if not erdma or not facts.torch.nccl:
        return None
    if version_tuple(facts.torch.nccl) < version_tuple(ERDMA_MIN_NCCL):
        return Finding(
            "fail",
            f"eRDMA devices ({', '.join(erdma)}) need NCCL >= {ERDMA_MIN_NCCL}; torch "
            f"{facts.torch.version} loads NCCL {facts.torch.nccl}",
            "pip install -U torch (its nvidia-nccl wheel brings a newer NCCL)",
        )
    return Finding("pass", f"eRDMA devices ({', '.join(erdma)}) with NCCL {facts.torch.nccl}")

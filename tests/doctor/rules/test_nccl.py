"""NCCL rules on recorded machines."""

from __future__ import annotations

from skylift.machine.facts import JobFacts, NetPluginFacts, RdmaDeviceFacts
from tests.doctor.recorded import load_facts, only, verdicts_of


def test_a_socket_ifname_naming_no_interface_fails_with_one_that_exists():
    facts = load_facts("h100_nvlink_efa", environment={"NCCL_SOCKET_IFNAME": "eth"})
    verdict = only(facts, "nccl-socket-ifname")
    assert verdict.status == "fail"
    assert verdict.fix.startswith("export NCCL_SOCKET_IFNAME=enp71s0")  # not lo, not docker0


def test_socket_ifname_prefix_exact_and_exclude_forms():
    facts = load_facts("h100_nvlink_efa")
    for value, status in (("enp", "pass"), ("=enp71s0", "pass"), ("=enp7", "fail"), ("^docker,lo", "pass")):
        facts.environment["NCCL_SOCKET_IFNAME"] = value
        assert only(facts, "nccl-socket-ifname").status == status, value


def test_socket_ifname_from_nccl_conf_counts_too():
    facts = load_facts("h100_nvlink_efa", nccl_conf={"NCCL_SOCKET_IFNAME": "ens"})
    assert only(facts, "nccl-socket-ifname").status == "fail"


def test_socket_ifname_is_not_a_gate_for_a_gloo_job():
    facts = load_facts("h100_nvlink_efa", environment={"NCCL_SOCKET_IFNAME": "eth"}, job=JobFacts(backend="gloo"))
    assert verdicts_of(facts, "nccl-socket-ifname") == []


def test_ib_disabled_on_an_ib_machine_warns():
    facts = load_facts("azure_ndv5", environment={"NCCL_IB_DISABLE": "1"})
    verdict = only(facts, "nccl-ib")
    assert verdict.status == "warn" and verdict.fix == "unset NCCL_IB_DISABLE"


def test_efa_without_the_plugin_on_the_path_fails_multi_node_with_the_folder():
    verdict = only(load_facts("h100_nvlink_efa"), "nccl-efa")
    assert verdict.status == "fail" and "sockets" in verdict.reason
    assert verdict.fix.startswith("export LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:")


def test_efa_with_the_plugin_loadable_passes():
    facts = load_facts("h100_nvlink_efa")
    facts.network.nccl_net_plugins = [
        NetPluginFacts(path="/opt/amazon/ofi-nccl/lib/libnccl-net.so", on_search_path=True)
    ]
    assert only(facts, "nccl-efa").status == "pass"


def test_azure_ndv5_without_a_topology_file_warns_with_the_variable():
    verdict = only(load_facts("azure_ndv5"), "nccl-topology")
    assert verdict.status == "warn"
    assert verdict.fix.startswith("export NCCL_TOPO_FILE=/opt/microsoft/ndv5-topo.xml")


def test_azure_ndv5_topology_set_in_nccl_conf_passes():
    facts = load_facts("azure_ndv5", nccl_conf={"NCCL_TOPO_FILE": "/opt/microsoft/ndv5-topo.xml"})
    assert only(facts, "nccl-topology").status == "pass"


def test_other_azure_machines_need_no_topology_file():
    facts = load_facts("azure_ndv5")
    facts.cloud.instance_type = "Standard_NC24ads_A100_v4"
    assert verdicts_of(facts, "nccl-topology") == []


def test_erdma_with_an_old_nccl_fails():
    facts = load_facts("a100_bf16")
    facts.network.rdma_devices = [RdmaDeviceFacts(name="erdma_0", kind="erdma", driver="erdma")]
    facts.torch.nccl = "2.18.5"
    verdict = only(facts, "nccl-erdma")
    assert verdict.status == "fail" and ">= 2.19" in verdict.reason
    facts.torch.nccl = "2.30.7"
    assert only(facts, "nccl-erdma").status == "pass"

"""The NCCL settings plan: what the workers get, never over the user's values."""

from __future__ import annotations

import json
import os

from skylift.machine.facts import JobFacts
from skylift.machine.nccl import (
    SETTINGS_VARIABLE,
    plan_nccl,
    recorded_settings,
    route_interface,
    selected_interfaces,
)
from tests.doctor.recorded import load_facts


def _settings(plan):
    return {setting.name: setting.value for setting in plan.chosen}


def test_h100_efa_gets_the_plugin_path_provider_and_rdma():
    plan = plan_nccl(load_facts("h100_nvlink_efa"), world_size=16, nnodes=2)
    chosen = _settings(plan)
    assert chosen["LD_LIBRARY_PATH"] == "/opt/amazon/ofi-nccl/lib:/usr/local/cuda/lib64"
    assert chosen["FI_PROVIDER"] == "efa"
    assert chosen["FI_EFA_USE_DEVICE_RDMA"] == "1"  # p5.48xlarge
    assert chosen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert chosen["NCCL_SOCKET_IFNAME"] == "enp71s0"  # no route to a master given: first physical NIC
    assert all(setting.reason for setting in plan.chosen)


def test_a_value_the_user_set_is_kept_and_recorded():
    facts = load_facts("h100_nvlink_efa", environment={"FI_PROVIDER": "tcp", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    plan = plan_nccl(facts, world_size=16, nnodes=2)
    assert "FI_PROVIDER" not in _settings(plan) and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in _settings(plan)
    kept = {setting.name: setting.value for setting in plan.kept}
    assert kept == {"FI_PROVIDER": "tcp", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def test_azure_ndv5_gets_its_topology_file_relaxed_ordering_and_device_order():
    chosen = _settings(plan_nccl(load_facts("azure_ndv5"), world_size=32, nnodes=4))
    assert chosen["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert chosen["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    assert chosen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert chosen["NCCL_SOCKET_IFNAME"] == "ib0"  # InfiniBand first


def test_pcie_peer_access_blocked_next_to_nvlink_limits_p2p_to_nvlink():
    facts = load_facts("h100_nvlink_efa")
    facts.gpu_links.append(
        facts.gpu_links[0].model_copy(update={"gpu_b": 2, "nvlink": False, "p2p_read": False, "path": "SYS"})
    )
    assert _settings(plan_nccl(facts, world_size=8, nnodes=1))["NCCL_P2P_LEVEL"] == "NVL"


def test_nothing_is_set_without_nccl():
    facts = load_facts("container_shm64")  # CPU only
    plan = plan_nccl(facts, world_size=2, nnodes=1)
    assert plan.chosen == [] and "NCCL not used" in plan.note
    facts = load_facts("a100_bf16", job=JobFacts(backend="gloo"))
    assert plan_nccl(facts, world_size=2, nnodes=1).chosen == []


def test_the_plan_travels_as_json_in_one_variable():
    plan = plan_nccl(load_facts("azure_ndv5"), world_size=32, nnodes=4)
    environment = plan.environment()
    record = json.loads(environment[SETTINGS_VARIABLE])
    assert {row["name"] for row in record["set"]} == {s.name for s in plan.chosen}
    assert all(set(row) == {"name", "value", "reason"} for row in record["set"])
    assert environment["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert recorded_settings(environment) == record  # what a worker reads back for run_start
    assert recorded_settings({}) is None and recorded_settings({SETTINGS_VARIABLE: "not json"}) is None


def test_single_node_jobs_leave_the_socket_interface_alone():
    assert "NCCL_SOCKET_IFNAME" not in _settings(plan_nccl(load_facts("azure_ndv5"), world_size=8, nnodes=1))


def test_the_route_to_loopback_is_lo():
    assert route_interface("127.0.0.1") in ("lo", "lo0")


def test_selected_interfaces_follows_nccl_syntax():
    names = ["lo", "eth0", "eth1", "ib0", "docker0"]
    assert selected_interfaces("eth", names) == ["eth0", "eth1"]
    assert selected_interfaces("=eth0", names) == ["eth0"]
    assert selected_interfaces("^lo,docker", names) == ["eth0", "eth1", "ib0"]
    assert selected_interfaces("^=eth0", names) == ["lo", "eth1", "ib0", "docker0"]


def test_the_launcher_exports_the_plan_and_prints_why(monkeypatch, capsys):
    from skylift.launch.launcher import Topology, _apply_nccl_settings

    facts = load_facts("azure_ndv5", environment={"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})
    for name in (
        "NCCL_TOPO_FILE",
        "NCCL_IB_PCI_RELAXED_ORDERING",
        SETTINGS_VARIABLE,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
    ):
        monkeypatch.setenv(name, "")  # recorded, so teardown removes what the launcher sets
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")
    _apply_nccl_settings(facts, Topology(nproc=8, nnodes=1))
    assert os.environ["NCCL_TOPO_FILE"] == "/opt/microsoft/ndv5-topo.xml"
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"  # the user's, kept
    record = json.loads(os.environ[SETTINGS_VARIABLE])
    assert {"name": "CUDA_DEVICE_ORDER", "value": "FASTEST_FIRST"}.items() <= record["kept"][0].items()
    printed = capsys.readouterr().err
    assert "skylift: NCCL: set NCCL_TOPO_FILE=/opt/microsoft/ndv5-topo.xml: " in printed
    assert "skylift: NCCL: kept CUDA_DEVICE_ORDER=FASTEST_FIRST" in printed

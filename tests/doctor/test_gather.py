"""Facts gathered on this (GPU-less) machine, and the readers pointed at fake trees."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from skylift.config.load import load_config
from skylift.doctor import gather
from skylift.doctor.gather import detect_container, gather_facts, reported_environment
from skylift.doctor.network import gather_network, read_nccl_conf

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def facts():
    return gather_facts(probe_metadata=False)


def test_this_machine_says_there_is_no_nvml(facts):
    assert facts.driver.nvml is False and facts.driver.reason
    assert facts.gpus == [] and facts.gpu_links == []
    assert any("no driver or GPU facts" in note for note in facts.notes)


def test_torch_build_is_read_without_a_gpu(facts):
    import torch

    assert facts.torch.version == torch.__version__ and facts.torch.cuda == torch.version.cuda
    assert facts.torch.cuda_available is False
    if torch.version.cuda:
        assert facts.torch.arch_list and all(arch.startswith(("sm_", "compute_")) for arch in facts.torch.arch_list)
        assert facts.torch.nccl and facts.torch.nccl.count(".") == 2


def test_host_facts(facts):
    assert facts.os.python == ".".join(map(str, sys.version_info[:3]))
    assert facts.os.kernel and facts.cpu.usable and facts.cpu.usable <= (facts.cpu.logical or 1)
    assert facts.memory.total_bytes and facts.shm.total_bytes == shutil.disk_usage("/dev/shm").total
    assert {disk.purpose for disk in facts.disks} == {"run_dir", "cache"}
    assert facts.packages["torch"] and "skylift" in facts.packages
    assert any(i.loopback for i in facts.network.interfaces)
    assert facts.collected_at.endswith("Z") and facts.schema_version == 1


def test_config_facts_include_the_job_and_its_disks(tmp_path):
    config = load_config(
        REPO_ROOT / "examples" / "quickstart.yaml", [f"run_dir={tmp_path / 'run'}", "data.num_workers=2"]
    )
    facts = gather_facts(config, config_path="examples/quickstart.yaml", nproc=2, probe_metadata=False)
    job = facts.job
    assert (job.nproc, job.num_workers, job.sample_bytes) == (2, 2, 8 * 8 * 4 + 8)
    assert job.memory.parameters > 0 and job.memory.activation_bytes > 0
    local = next(disk for disk in facts.disks if disk.purpose == "checkpoint_local")
    assert local.path == str(tmp_path / "run" / "checkpoints") and local.exists is False and local.free_bytes


def test_a_launch_without_the_checks_skips_the_memory_trace_but_keeps_the_job(tmp_path):
    """--no-doctor on several processes still gathers the facts the NCCL settings read; the
    memory estimate (a meta trace, most of a start-up's cost) is only for the checks."""
    from skylift.doctor.gate import check_before_start

    config = load_config(REPO_ROOT / "examples" / "quickstart.yaml", [f"run_dir={tmp_path / 'run'}"])
    unchecked = check_before_start(config, command="run", nproc=2, nnodes=1, enforce=False)
    assert unchecked.job.nproc == 2 and unchecked.job.backend == config.distributed.backend
    assert unchecked.job.memory is None
    checked = check_before_start(config, command="run", nproc=2, nnodes=1, enforce=True)
    assert checked.job.memory.total_bytes > 0


def test_environment_keeps_the_families_nccl_and_torch_read():
    environ = {
        "NCCL_DEBUG": "INFO",
        "CUDA_VISIBLE_DEVICES": "0",
        "TORCH_HOME": "/x",
        "FI_PROVIDER": "efa",
        "LD_LIBRARY_PATH": "/a",
        "HOME": "/root",
        "AWS_REGION": "us-east-1",
    }
    assert set(reported_environment(environ)) == {
        "NCCL_DEBUG",
        "CUDA_VISIBLE_DEVICES",
        "TORCH_HOME",
        "FI_PROVIDER",
        "LD_LIBRARY_PATH",
    }


def test_containers_are_told_apart(tmp_path):
    assert detect_container({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, tmp_path).kind == "kubernetes"
    assert detect_container({}, tmp_path).kind is None
    (tmp_path / "proc/1").mkdir(parents=True)
    (tmp_path / "proc/1/cgroup").write_text("0::/system.slice/containerd.service\n")
    assert detect_container({}, tmp_path).kind == "containerd"
    (tmp_path / ".dockerenv").touch()
    assert detect_container({}, tmp_path).kind == "docker"


def test_cgroup_cpu_quota_v2_and_v1(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert gather._cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert gather._cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu/cpu.cfs_quota_us").write_text("400000")
    (tmp_path / "cpu/cpu.cfs_period_us").write_text("100000")
    assert gather._cgroup_cpu_quota(tmp_path) == 4.0


def _fake_rdma(root: Path, name: str, driver: str, link_layer: str) -> None:
    device = root / "sys/class/infiniband" / name
    (device / "ports/1").mkdir(parents=True)
    (device / "ports/1/link_layer").write_text(link_layer + "\n")
    (device / "ports/1/state").write_text("4: ACTIVE\n")
    (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    (device / "device").mkdir()
    os.symlink(root / "drivers" / driver, device / "device/driver")


def test_rdma_devices_and_net_plugins_from_a_fake_tree(tmp_path):
    for name, driver, layer in (
        ("rdmap16s27", "efa", "Ethernet"),
        ("mlx5_0", "mlx5_core", "InfiniBand"),
        ("mlx5_1", "mlx5_core", "Ethernet"),
        ("erdma_0", "erdma", "Ethernet"),
    ):
        _fake_rdma(tmp_path, name, driver, layer)
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "libnccl-net-ofi.so").touch()
    conf = tmp_path / "ld.so.conf.d"
    conf.mkdir()
    network = gather_network({"LD_LIBRARY_PATH": str(plugins)}, sys_root=str(tmp_path), ld_conf_dir=str(conf))
    kinds = {device.name: (device.kind, device.state) for device in network.rdma_devices}
    assert kinds == {
        "rdmap16s27": ("efa", "ACTIVE"),
        "mlx5_0": ("ib", "ACTIVE"),
        "mlx5_1": ("roce", "ACTIVE"),
        "erdma_0": ("erdma", "ACTIVE"),
    }
    assert [(p.path, p.on_search_path) for p in network.nccl_net_plugins] == [
        (str(plugins / "libnccl-net-ofi.so"), True)
    ]
    (conf / "plugins.conf").write_text(f"# a comment\n{plugins}\n")
    network = gather_network({}, sys_root=str(tmp_path), ld_conf_dir=str(conf))
    assert network.nccl_net_plugins[0].on_search_path is True


def test_nccl_conf_is_read_like_nccl(tmp_path):
    first, second = tmp_path / "nccl.conf", tmp_path / "user.conf"
    first.write_text("# site\nNCCL_TOPO_FILE=/opt/microsoft/ndv5-topo.xml\nNCCL_DEBUG=WARN\n")
    second.write_text("NCCL_DEBUG = INFO\n")
    assert read_nccl_conf([first, second, tmp_path / "missing"]) == {
        "NCCL_TOPO_FILE": "/opt/microsoft/ndv5-topo.xml",
        "NCCL_DEBUG": "INFO",
    }

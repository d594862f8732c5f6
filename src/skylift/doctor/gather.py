"""Read this machine into a :class:`~skylift.machine.facts.Facts` object.

Each part is read on its own and a part that cannot be read leaves ``None`` and a
line in ``facts.notes``: the doctor must work on a laptop without CUDA, in a
container without /sys, and on a GPU node whose NVML is broken. Nothing here
touches the network except the instance-type request on a detected cloud.
"""

from __future__ import annotations

import datetime
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from skylift.doctor.system import gather_disks, read_text
from skylift.machine.facts import ContainerFacts, CpuFacts, Facts, MemoryFacts, OsFacts, ShmFacts

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig
    from skylift.machine.facts import JobFacts

__all__ = [
    "ENVIRONMENT_PREFIXES",
    "KEY_PACKAGES",
    "detect_container",
    "gather_facts",
    "reported_environment",
]

ENVIRONMENT_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "FI_")
"""Variables reported (values redacted where secret), and the ones NCCL settings read."""
KEY_PACKAGES = (
    "torch",
    "torchvision",
    "numpy",
    "pydantic",
    "nvidia-ml-py",
    "psutil",
    "safetensors",
    "boto3",  # skylift.storage's S3-compatible client (the s3 extra)
    "botocore",
    "tokenizers",
    "nvidia-nccl-cu13",
    "nvidia-nccl-cu12",
    "nvidia-cudnn-cu13",
    "nvidia-cudnn-cu12",
)
def gather_facts(
    config: RunConfig | None = None,
    *,
    config_path: str | None = None,
    nproc: int = 1,
    nnodes: int = 1,
    job_source: str | None = None,
    probe_metadata: bool = True,
    job_memory: bool = True,
) -> Facts:
    """Everything the rules need, from this machine and, when given, the run config.

    Args:
        config: the run config checked against this machine (``--config``).
        config_path: where it was read from (reported, redacted).
        nproc, nnodes: the job's shape, for ``skylift run``/``launch`` checks.
        job_source: ``"launch"`` for a script without a config: job facts without one.
        probe_metadata: ask a detected cloud's metadata service for the instance type.
        job_memory: estimate the job's memory (a meta-device trace of its model).

    Example:
        >>> gather_facts().torch.version
        '2.14.1+cu130'
    """
    from skylift import __version__
    from skylift.doctor.gpu import gather_gpus, gather_torch
    from skylift.doctor.instance import gather_cloud
    from skylift.doctor.network import gather_network, read_nccl_conf

    environ = dict(os.environ)
    facts = Facts(skylift_version=__version__, collected_at=_now_iso())
    facts.os, facts.cpu, facts.memory, facts.shm = _os(), _cpu(), _memory(), _shm(Path("/dev/shm"))
    facts.torch = gather_torch()
    facts.driver, facts.gpus, facts.gpu_links = gather_gpus()
    facts.network = gather_network(environ)
    facts.environment = reported_environment(environ)
    facts.nccl_conf = read_nccl_conf([Path("/etc/nccl.conf"), Path.home() / ".nccl.conf"])
    facts.files = _files_of_interest(facts)
    facts.container = detect_container(environ)
    facts.cloud = gather_cloud(probe_metadata=probe_metadata)
    facts.packages = _packages()
    facts.job = _job(config, config_path, nproc, nnodes, job_source, job_memory)
    facts.disks = gather_disks(config)
    facts.notes = _notes(facts)
    return facts


def _job(
    config: RunConfig | None, config_path: str | None, nproc: int, nnodes: int, source: str | None, memory: bool
) -> JobFacts | None:
    from skylift.machine.facts import JobFacts

    if config is not None:
        from skylift.doctor.job import job_facts

        return job_facts(config, config_path=config_path, nproc=nproc, nnodes=nnodes, memory=memory)
    if source == "launch":
        return JobFacts(source="launch", nproc=nproc, nnodes=nnodes)
    return None


def reported_environment(environ: dict[str, str]) -> dict[str, str]:
    """The variables of :data:`ENVIRONMENT_PREFIXES` and ``LD_LIBRARY_PATH``."""
    chosen = {name: value for name, value in environ.items() if name.startswith(ENVIRONMENT_PREFIXES)}
    if "LD_LIBRARY_PATH" in environ:
        chosen["LD_LIBRARY_PATH"] = environ["LD_LIBRARY_PATH"]
    return dict(sorted(chosen.items()))


def _os() -> OsFacts:
    try:
        distribution = platform.freedesktop_os_release().get("PRETTY_NAME")
    except OSError:
        distribution = None
    libc_name, libc_version = platform.libc_ver()
    return OsFacts(
        system=platform.system(),
        distribution=distribution,
        kernel=platform.release(),
        glibc=libc_version if libc_name == "glibc" else None,
        machine=platform.machine(),
        python=platform.python_version(),
    )


def _cpu() -> CpuFacts:
    import torch

    from skylift.data.autotune import available_cpus
    from skylift.train.precision import DeviceInfo

    quota = _cgroup_cpu_quota()
    usable = available_cpus()
    if quota is not None:
        usable = max(1, min(usable, int(quota)))
    device = DeviceInfo.detect(torch.device("cpu"))
    return CpuFacts(
        usable=usable, logical=os.cpu_count(), quota=quota, model=device.name, native_bf16=device.cpu_native_bf16
    )


def _cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs allowed by the cgroup (v2 ``cpu.max``, v1 ``cfs_quota_us``); None: no quota."""
    text = read_text(root / "cpu.max")
    if text:
        quota, _, period = text.partition(" ")
        return int(quota) / int(period or 100000) if quota.isdigit() else None
    quota_us, period_us = read_text(root / "cpu/cpu.cfs_quota_us"), read_text(root / "cpu/cpu.cfs_period_us")
    if quota_us and period_us and quota_us.lstrip("-").isdigit() and int(quota_us) > 0:
        return int(quota_us) / int(period_us)
    return None


def _memory(root: Path = Path("/sys/fs/cgroup")) -> MemoryFacts:
    import psutil

    memory = psutil.virtual_memory()
    limit_text = read_text(root / "memory.max") or read_text(root / "memory/memory.limit_in_bytes")
    limit = int(limit_text) if limit_text and limit_text.isdigit() else None
    # cgroup v1 writes "no limit" as a huge page-rounded number.
    if limit is not None and limit >= memory.total:
        limit = None
    return MemoryFacts(total_bytes=memory.total, available_bytes=memory.available, limit_bytes=limit)


def _shm(path: Path) -> ShmFacts:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return ShmFacts(path=str(path), exists=False)
    return ShmFacts(path=str(path), exists=True, total_bytes=usage.total, free_bytes=usage.free)


def detect_container(environ: dict[str, str], root: Path = Path("/")) -> ContainerFacts:
    """Which container runtime this process runs under, and the file that says so."""
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return ContainerFacts(kind="kubernetes", evidence="KUBERNETES_SERVICE_HOST is set")
    if (root / ".dockerenv").exists():
        return ContainerFacts(kind="docker", evidence="/.dockerenv exists")
    if (root / "run/.containerenv").exists():
        return ContainerFacts(kind="podman", evidence="/run/.containerenv exists")
    cgroup = read_text(root / "proc/1/cgroup") or ""
    for marker, kind in (
        ("kubepods", "kubernetes"),
        ("docker", "docker"),
        ("containerd", "containerd"),
        ("lxc", "lxc"),
    ):
        if marker in cgroup:
            return ContainerFacts(kind=kind, evidence=f"/proc/1/cgroup mentions {marker}")
    return ContainerFacts()


def _files_of_interest(facts: Facts) -> dict[str, bool]:
    from skylift.machine.nccl import AZURE_NDV5_TOPOLOGY_FILE

    paths = [AZURE_NDV5_TOPOLOGY_FILE, facts.nccl_setting("NCCL_TOPO_FILE")]
    return {path: os.path.isfile(path) for path in paths if path}


def _packages() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in ("skylift", *KEY_PACKAGES):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _notes(facts: Facts) -> list[str]:
    notes = []
    if not facts.driver.nvml:
        notes.append(f"no driver or GPU facts: {facts.driver.reason}")
    if facts.torch.error:
        notes.append(facts.torch.error)
    if facts.cloud.name is None:
        notes.append("no cloud detected from DMI (set SKYLIFT_CLOUD to force one); metadata service not asked")
    elif facts.cloud.instance_type_error:
        notes.append(f"{facts.cloud.name} instance type unknown: {facts.cloud.instance_type_error}")
    if facts.shm.exists is False:
        notes.append(f"{facts.shm.path} is missing: DataLoader workers cannot share memory")
    return notes


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

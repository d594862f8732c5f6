"""The facts ``skylift doctor`` gathers: one typed object, the input of every rule.

The models are the documented ``facts`` part of ``skylift doctor --json`` (schema
``SCHEMA_VERSION``; see :mod:`skylift.doctor.render`). Every field has a default, so a
recorded fact set (tests/doctor/facts/*.json) names only what matters to it, and an
unknown key is an error, so a typo in one fails loudly. ``None`` always means "could
not be read here", never zero.

Gathering lives elsewhere (:mod:`skylift.doctor.gather`); nothing here reads the machine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "SCHEMA_VERSION",
    "CloudFacts",
    "ContainerFacts",
    "CpuFacts",
    "DiskFacts",
    "DriverFacts",
    "Facts",
    "GpuFacts",
    "GpuLinkFacts",
    "InterfaceFacts",
    "JobFacts",
    "MemoryEstimate",
    "MemoryFacts",
    "NetPluginFacts",
    "NetworkFacts",
    "OsFacts",
    "RdmaDeviceFacts",
    "ShmFacts",
    "TorchFacts",
]

SCHEMA_VERSION = 1
"""Bumped when a field of the JSON output is renamed, removed or changes meaning;
adding a field does not bump it."""


class _Facts(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class OsFacts(_Facts):
    system: str = "Linux"
    distribution: str | None = None
    """``PRETTY_NAME`` of /etc/os-release."""
    kernel: str | None = None
    glibc: str | None = None
    machine: str | None = None
    """``x86_64``, ``aarch64``..."""
    python: str | None = None


class CpuFacts(_Facts):
    usable: int | None = None
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    logical: int | None = None
    """Logical CPUs of the machine (``os.cpu_count()``)."""
    quota: float | None = None
    """The cgroup CPU quota in CPUs, ``None`` when unlimited."""
    model: str | None = None
    native_bf16: bool = False
    """AVX512-BF16 or AMX that PyTorch's kernels use (see :mod:`skylift.train.precision`)."""


class MemoryFacts(_Facts):
    total_bytes: int | None = None
    available_bytes: int | None = None
    limit_bytes: int | None = None
    """The cgroup memory limit, ``None`` when unlimited."""


class ShmFacts(_Facts):
    path: str = "/dev/shm"
    exists: bool | None = None
    """``None`` when not gathered (a recorded set that leaves it out)."""
    total_bytes: int | None = None
    free_bytes: int | None = None


DiskPurpose = Literal["run_dir", "cache", "checkpoint_local", "checkpoint_memory"]


class DiskFacts(_Facts):
    purpose: DiskPurpose
    path: str
    exists: bool = True
    """False when the folder is not created yet: the figures are its nearest parent's."""
    free_bytes: int | None = None
    total_bytes: int | None = None
    device: int | None = None
    """``st_dev`` of the file system, so folders that share one share its free space."""


class TorchFacts(_Facts):
    installed: bool = True
    version: str | None = None
    cuda: str | None = None
    """``torch.version.cuda`` ('13.0'); ``None`` on CPU and ROCm builds."""
    hip: str | None = None
    cudnn: int | None = None
    """``torch.backends.cudnn.version()``: 92400 is 9.24.0."""
    nccl: str | None = None
    """NCCL version torch loads, e.g. '2.30.7'."""
    arch_list: list[str] = Field(default_factory=list)
    """Compiled kernels (``sm_90``) and PTX (``compute_90``) of the wheel."""
    cuda_available: bool = False
    device_count: int = 0
    error: str | None = None


class DriverFacts(_Facts):
    nvml: bool = False
    """NVML answered; without it no driver or GPU facts are known."""
    reason: str | None = None
    """Why NVML did not answer."""
    version: str | None = None
    """The kernel driver, e.g. '570.124.06'."""
    cuda: str | None = None
    """The newest CUDA the driver supports, e.g. '12.8'."""


class GpuFacts(_Facts):
    index: int
    name: str
    capability: tuple[int, int] | None = None
    memory_total_bytes: int | None = None
    ecc_enabled: bool | None = None
    mig_enabled: bool | None = None
    pcie_generation: int | None = None
    pcie_width: int | None = None
    pcie_max_generation: int | None = None
    pcie_max_width: int | None = None
    nvlinks_active: int | None = None
    bus_id: str | None = None


class GpuLinkFacts(_Facts):
    gpu_a: int
    gpu_b: int
    path: str | None = None
    """Closest common ancestor as ``nvidia-smi topo -m`` writes it: ``NV`` (NVLink),
    ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``."""
    nvlink: bool = False
    p2p_read: bool | None = None
    """The driver allows peer-to-peer reads between the two."""


class InterfaceFacts(_Facts):
    name: str
    up: bool = True
    loopback: bool = False
    mtu: int | None = None
    speed_mbps: int | None = None


RdmaKind = Literal["ib", "roce", "efa", "erdma", "other"]


class RdmaDeviceFacts(_Facts):
    name: str
    kind: RdmaKind = "other"
    driver: str | None = None
    link_layer: str | None = None
    state: str | None = None
    """Port state of the first port, e.g. ``ACTIVE``."""


class NetPluginFacts(_Facts):
    path: str
    on_search_path: bool
    """In a folder the dynamic loader searches (``LD_LIBRARY_PATH``, the ld.so cache
    folders), so NCCL's ``dlopen`` finds it."""


class NetworkFacts(_Facts):
    interfaces: list[InterfaceFacts] = Field(default_factory=list)
    rdma_devices: list[RdmaDeviceFacts] = Field(default_factory=list)
    nccl_net_plugins: list[NetPluginFacts] = Field(default_factory=list)


class ContainerFacts(_Facts):
    kind: str | None = None
    """``docker``, ``podman``, ``kubernetes``, ``containerd``, ``lxc``; ``None`` on a host."""
    evidence: str | None = None


class CloudFacts(_Facts):
    name: str | None = None
    source: str | None = None
    """``dmi`` or ``SKYLIFT_CLOUD``; ``None`` off-cloud."""
    instance_type: str | None = None
    instance_type_error: str | None = None


class MemoryEstimate(_Facts):
    """Peak device memory of one training rank, from a trace on the meta device."""

    parameters: int = 0
    trainable_parameters: int = 0
    """Parameters that get gradients and optimizer state (with adapters: the adapters')."""
    adapters: str | None = None
    """What trains instead of every weight ("LoRA rank 16", "QLoRA ..."); ``None``: every weight."""
    frozen_weight_bytes: int = 0
    """The part of ``parameter_bytes`` that is frozen (the adapters' base, as stored)."""
    quantized_parameters: int = 0
    """Frozen parameters held in 4-bit NF4 (QLoRA)."""
    reference_bytes: int = 0
    """DPO's frozen reference copy of the weights (``recipe.dpo.reference: frozen_copy``)."""
    parameter_bytes: int = 0
    gradient_bytes: int = 0
    """Gradients, with DDP's bucket copy of them when there are several ranks."""
    bucket_bytes: int = 0
    """The part of ``gradient_bytes`` that is DDP's bucket copy."""
    optimizer_bytes: int = 0
    ema_bytes: int = 0
    """The EMA copy of the weights and buffers (``optim.ema_decay``)."""
    autocast_weight_bytes: int = 0
    """Half copies of the weights that bf16/fp16 autocast casts and backward keeps."""
    activation_bytes: int | None = None
    """Tensors saved for backward by one micro-batch's forward; ``None`` when unknown."""
    total_bytes: int = 0
    checkpoint_bytes: int = 0
    """One checkpoint: fp32 weights plus optimizer state (with adapters: theirs only)."""
    shard_count: int = 1
    """Ranks the weights, gradients and optimizer state are split over (FSDP); 1: DDP."""
    unsharded_bytes: int = 0
    """FSDP: what a rank gathers for the step (the root group, two blocks, a reduce-scatter input)."""
    host_bytes: int = 0
    """FSDP ``cpu_offload``: the rank's sharded state in host memory instead of on the GPU."""
    sharding: str | None = None
    """How the state is sharded, in words ("sharded over 8 ranks (FSDP2)"); ``None``: not sharded."""
    note: str | None = None


class JobFacts(_Facts):
    """What the job asks of this machine (``--config``, or ``run``/``launch`` flags)."""

    source: Literal["config", "launch"] = "config"
    config_path: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: str | None = None
    """``precision`` of the config; ``None`` when not known (``launch``)."""
    backend: str = "auto"
    nproc: int = 1
    nnodes: int = 1
    num_workers: int | Literal["auto"] = 0
    micro_batch_size: int | None = None
    sample_bytes: int | None = None
    """Bytes of one training sample as the loader ships it to the main process."""
    streaming: bool = False
    cache_bytes: int = 0
    """Shard cache the run may fill (``data.cache_limit_gib`` when streaming)."""
    checkpoint_local: bool = True
    """Checkpoints land on this machine's disk (``checkpoint.root`` local or
    ``checkpoint.local_root`` set)."""
    checkpoint_keep: int = 3
    memory: MemoryEstimate | None = None


class Facts(_Facts):
    """Everything the rules may look at, gathered once."""

    schema_version: int = SCHEMA_VERSION
    skylift_version: str | None = None
    collected_at: str | None = None
    """ISO 8601 UTC time of gathering; rules about dates (driver end of life) use it."""
    os: OsFacts = Field(default_factory=OsFacts)
    cpu: CpuFacts = Field(default_factory=CpuFacts)
    memory: MemoryFacts = Field(default_factory=MemoryFacts)
    shm: ShmFacts = Field(default_factory=ShmFacts)
    disks: list[DiskFacts] = Field(default_factory=list)
    torch: TorchFacts = Field(default_factory=TorchFacts)
    driver: DriverFacts = Field(default_factory=DriverFacts)
    gpus: list[GpuFacts] = Field(default_factory=list)
    gpu_links: list[GpuLinkFacts] = Field(default_factory=list)
    network: NetworkFacts = Field(default_factory=NetworkFacts)
    environment: dict[str, str] = Field(default_factory=dict)
    """``NCCL_*``, ``CUDA_*``, ``TORCH_*``, ``FI_*`` variables (and ``LD_LIBRARY_PATH``)."""
    nccl_conf: dict[str, str] = Field(default_factory=dict)
    """Settings of /etc/nccl.conf and ~/.nccl.conf, which NCCL reads as variables."""
    files: dict[str, bool] = Field(default_factory=dict)
    """Whether files the rules care about exist (``NCCL_TOPO_FILE``'s, Azure's topology file)."""
    container: ContainerFacts = Field(default_factory=ContainerFacts)
    cloud: CloudFacts = Field(default_factory=CloudFacts)
    packages: dict[str, str | None] = Field(default_factory=dict)
    """Versions of skylift's key dependencies; ``None``: not installed."""
    notes: list[str] = Field(default_factory=list)
    """What could not be gathered, and why."""
    job: JobFacts | None = None

    def nccl_setting(self, name: str) -> str | None:
        """The value NCCL will see for ``name``: the environment first, then nccl.conf."""
        return self.environment.get(name, self.nccl_conf.get(name))

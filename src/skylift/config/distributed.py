"""How the ranks share the work: the collective backend and DDP or FSDP2 sharding."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from skylift.config.section import Section

__all__ = ["DistributedConfig", "ElasticNodes", "FsdpConfig"]


class FsdpConfig(Section):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) settings, read when ``distributed.strategy: fsdp``."""

    block_types: list[str] = Field(default_factory=list)
    """Class names of the blocks to shard one by one before the root (for example
    ``LlamaDecoderLayer``); a name that matches no module of the model is an error that
    lists the model's module classes. Empty: the model's own list (a Hugging Face model's
    ``_no_split_modules``), else torchvision's residual blocks (``BasicBlock``,
    ``Bottleneck``) and ``torch.nn``'s transformer layers; none present: the whole model
    is one unit. Each block's parameters are gathered just before it runs, so the
    largest block bounds the unsharded memory. With ``compile.enabled`` each block is
    compiled before it is sharded (the root, when there are no blocks)."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward and gather them again
    in backward (ZeRO-3: least memory). False keeps them until backward (ZeRO-2-like:
    one all-gather fewer per block and step, more memory)."""

    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """Precision of the gradient reduce-scatter. The parameters' compute precision
    follows ``precision`` (bf16 parameters under bf16); fp32 reduction keeps the
    summed gradients exact to fp32 rounding."""

    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in host memory and
    step the optimizer on the CPU: fits a larger model, at the cost of host-device copies
    (pinned on CUDA). Not with ``precision: fp16``."""


class ElasticNodes(Section):
    """An elastic node count: torchrun's c10d rendezvous with ``--nnodes MIN:MAX``.

    A node that leaves (a spot notice, a crash) shrinks the job, one that joins grows it
    back; each change is a checkpoint and a restart of the workers at the new world size,
    with the global batch kept (accumulation follows the world size)."""

    min: int = Field(default=1, ge=1)
    """Fewest nodes the job trains on. Below it, the survivors wait ``rendezvous_timeout_s``
    for a replacement, then stop with their committed checkpoint and exit 143 (requeue)."""

    max: int = Field(default=1, ge=1)
    """Most nodes the job trains on; a node beyond it waits as a spare until one leaves."""

    rendezvous_timeout_s: float = Field(default=300.0, gt=0.0)
    """How long a (re)forming job waits for at least ``min`` nodes before it gives up."""

    heartbeat_s: float = Field(default=5.0, gt=0.0)
    """Interval of each agent's keep-alive in the rendezvous; a node silent for three
    intervals counts as gone (a SIGKILLed node is noticed by its peers' collectives sooner)."""

    last_call_s: float = Field(default=30.0, gt=0.0)
    """Once ``min`` nodes are in a (re)forming rendezvous, how long it waits for more
    before it starts at the size it has (torchrun's ``last_call_timeout``; whole seconds,
    rounded up). Every restart to shrink pays it; a shorter one starts a job whose nodes
    come up minutes apart on fewer nodes, and each late node then costs a restart."""

    max_failures: int = Field(default=3, ge=0)
    """Restarts allowed after a worker crash (a lost peer, an error); membership changes
    from a notice or a joining node do not count."""

    @model_validator(mode="after")
    def _min_not_above_max(self) -> ElasticNodes:
        if self.min > self.max:
            raise ValueError(f"distributed.nodes.min ({self.min}) is above distributed.nodes.max ({self.max}); "
                             "set min <= max, e.g. {min: 1, max: 4}")
        return self


class DistributedConfig(Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: ``auto`` takes NCCL on CUDA and gloo on CPU."""

    timeout_s: float = Field(default=600.0, gt=0.0)
    """How long a collective may wait for a peer before the run fails instead of hanging."""

    strategy: Literal["ddp", "fsdp"] = "ddp"
    """``ddp``: every rank holds the whole model, gradients and optimizer state
    (fastest while they fit). ``fsdp``: FSDP2 shards all three over the ranks, so
    per-rank memory falls with the world size: for models larger than one GPU. It works
    on one rank too. Under ``fsdp``, ``optim.ema_decay`` and ``channels_last`` are refused
    (an unsharded average on every rank; FSDP2 shards only contiguous parameters)."""

    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    """FSDP2 settings (``strategy: fsdp``)."""

    nodes: ElasticNodes | None = None
    """An elastic node count ``{min, max}`` (also ``--nnodes MIN:MAX``): the job continues
    on fewer nodes after a reclaim and grows back when a node returns. None: the fixed
    ``--nnodes`` (default 1), where losing a node stops the whole job for a requeue."""

    find_unused_parameters: bool = False
    """DDP ``find_unused_parameters``: needed only for models with branches that skip
    parameters; it costs a graph traversal per step."""

    bucket_cap_mib: int = Field(default=25, ge=1)
    """DDP gradient bucket size in MiB."""

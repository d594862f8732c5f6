"""Device memory of one training rank: the one model ``skylift doctor`` and ``skylift plan`` share.

Given what a meta-device trace tells about the model (:class:`ModelMemory`) and where it
trains (precision, ranks), :func:`training_memory` adds up what a rank holds at the
peak of a step, the end of a micro-batch's forward, when autograd still holds every
tensor it saved for backward::

    weights              fp32 master weights (autocast keeps them in fp32)
    gradients            fp32, one per trainable weight
    optimizer state      fp32, per trainable weight: AdamW 2 (moments), SGD with momentum 1, plain SGD 0
    DDP buckets          with several ranks, DDP's flattened copy of the gradients (bucket_cap_mib sets
                         the size of each bucket, not their total, which is every trainable weight)
    EMA                  optim.ema_decay: an fp32 copy of the weights and buffers
    autocast weights     bf16/fp16: the half copy of the weights autocast casts and backward keeps
    activations          the tensors autograd saves for backward, per sample, times the micro-batch

An estimate: allocator fragmentation, cuBLAS/cuDNN workspaces and the CUDA context take
the rest of a GPU, hence :data:`MEMORY_HEADROOM`. Torch-free arithmetic; the trace itself
is :func:`skylift.doctor.memory.trace_model_memory`. ``shard_count`` leaves room for
sharded data parallel (weights, gradients and optimizer state split over that many ranks);
only 1, plain DDP, is used today.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "MEMORY_HEADROOM",
    "MemoryBreakdown",
    "ModelMemory",
    "fits_device",
    "optimizer_state_copies",
    "training_memory",
]

MEMORY_HEADROOM = 0.9
"""Share of a device's memory a job fits in (the CUDA context and fragmentation take the rest)."""

_FP32_BYTES = 4
_HALF_BYTES = 2


def fits_device(total_bytes: float, device_memory_bytes: float) -> bool:
    """Whether a rank's peak of ``total_bytes`` fits :data:`MEMORY_HEADROOM` of the device:
    the one "does it fit" both ``skylift doctor`` and ``skylift plan`` answer."""
    return total_bytes <= MEMORY_HEADROOM * device_memory_bytes


def optimizer_state_copies(name: str, momentum: float) -> int:
    """Copies of each trainable weight the optimizer keeps as state: AdamW's two moments,
    SGD's momentum buffer (none without momentum)."""
    if name == "adamw":
        return 2
    if name == "sgd":
        return 1 if momentum else 0
    raise ValueError(f"optim.name {name!r}: no memory model for it; known: adamw, sgd")


@dataclass(frozen=True, kw_only=True)
class ModelMemory:
    """What the memory of training a model depends on before the machine is chosen."""

    parameters: int
    trainable_parameters: int
    buffer_elements: int = 0
    """BatchNorm statistics and the like (copied by the EMA)."""
    optimizer_state_copies: int
    """From :func:`optimizer_state_copies` of the job's ``optim`` section."""
    ema: bool = False
    """``optim.ema_decay`` is set."""
    saved_float_elements_per_sample: float | None = None
    """Floating-point elements autograd saves for backward per sample (``None``: not traced)."""
    saved_other_bytes_per_sample: float = 0.0
    """Bytes of the other saved tensors per sample (integer labels, masks)."""
    note: str | None = None
    """Why the activations are unknown, if they are."""

    @classmethod
    def of(cls, module: Any, optim: Any, **traced: Any) -> ModelMemory:
        """The counts of a ``torch.nn.Module`` (on meta or a device) trained with the
        ``optim`` config section; ``traced``: the saved-tensor fields, where traced."""
        parameters = list(module.parameters())
        return cls(
            parameters=sum(p.numel() for p in parameters),
            trainable_parameters=sum(p.numel() for p in parameters if p.requires_grad),
            buffer_elements=sum(b.numel() for b in module.buffers()),
            optimizer_state_copies=optimizer_state_copies(optim.name, optim.momentum),
            ema=optim.ema_decay is not None,
            **traced,
        )


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """One rank's peak, part by part, in bytes."""

    micro_batch_size: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    bucket_bytes: int
    ema_bytes: int
    autocast_weight_bytes: int
    activation_bytes: int | None
    """``None``: the model's activations were not traced."""

    @property
    def state_bytes(self) -> int:
        """Everything but the activations: what a micro-batch of any size adds to."""
        return (self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.bucket_bytes
                + self.ema_bytes + self.autocast_weight_bytes)

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + (self.activation_bytes or 0)

    def fits(self, device_memory_bytes: float) -> bool:
        """Whether the whole peak fits the device (:func:`fits_device`)."""
        return fits_device(self.total_bytes, device_memory_bytes)


def training_memory(model: ModelMemory, micro_batch_size: int, *, half_precision: bool, world_size: int,
                    shard_count: int = 1) -> MemoryBreakdown:
    """One rank's peak memory training ``model`` on micro-batches of ``micro_batch_size``.

    Args:
        half_precision: bf16/fp16 autocast (activations and the cast weights at 2 bytes).
        world_size: ranks; above 1, DDP's gradient buckets count.
        shard_count: ranks the weights, gradients and optimizer state are split over
            (sharded data parallel); 1: each rank holds all of them.

    Example:
        >>> model = ModelMemory(parameters=1000, trainable_parameters=1000, optimizer_state_copies=2,
        ...                     saved_float_elements_per_sample=10.0)
        >>> training_memory(model, 4, half_precision=False, world_size=1).total_bytes
        16160
    """
    if micro_batch_size < 0 or world_size < 1 or shard_count < 1:
        raise ValueError(f"micro_batch_size {micro_batch_size}, world_size {world_size} and shard_count "
                         f"{shard_count} must be >= 0, >= 1 and >= 1")
    trainable = model.trainable_parameters * _FP32_BYTES
    activations = None
    if model.saved_float_elements_per_sample is not None:
        element_bytes = _HALF_BYTES if half_precision else _FP32_BYTES
        per_sample = model.saved_float_elements_per_sample * element_bytes + model.saved_other_bytes_per_sample
        activations = round(per_sample * micro_batch_size)
    return MemoryBreakdown(
        micro_batch_size=micro_batch_size,
        parameter_bytes=model.parameters * _FP32_BYTES // shard_count,
        gradient_bytes=trainable // shard_count,
        optimizer_state_bytes=trainable * model.optimizer_state_copies // shard_count,
        bucket_bytes=trainable if world_size > 1 and shard_count == 1 else 0,
        ema_bytes=(model.parameters + model.buffer_elements) * _FP32_BYTES if model.ema else 0,
        autocast_weight_bytes=model.parameters * _HALF_BYTES if half_precision else 0,
        activation_bytes=activations,
    )

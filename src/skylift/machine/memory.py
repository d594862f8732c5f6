"""Device memory of one training rank: the one model ``skylift doctor`` and ``skylift plan`` share.

Given what a meta-device trace tells about the model (:class:`ModelMemory`) and where it
trains (precision, ranks, :class:`Sharding`), :func:`training_memory` adds up what a rank
holds at the peak of a step, the end of a micro-batch's forward, when autograd still
holds every tensor it saved for backward::

    weights              fp32 master weights of the trainable parameters (autocast keeps them in
                         fp32); frozen ones (``recipe.lora``'s base) at the bytes they are stored in:
                         their dtype, or 4-bit NF4 with its constants (:func:`nf4_bytes_per_parameter`)
    gradients            fp32, one per trainable weight (a frozen weight has none)
    optimizer state      fp32, per trainable weight: AdamW 2 (moments), SGD with momentum 1, plain SGD 0
    DDP buckets          with several ranks, DDP's flattened copy of the gradients (bucket_cap_mib sets
                         the size of each bucket, not their total, which is every trainable weight)
    EMA                  optim.ema_decay: a copy of the weights as stored (``AveragedModel`` deep-copies
                         the whole model, frozen base too) and of the buffers
    autocast weights     bf16/fp16: the half copy of the weights autocast casts and backward keeps;
                         a 4-bit weight has none (bitsandbytes dequantises it per call, in forward and
                         again in backward), nor has a frozen weight in an activation-checkpointed
                         block (autocast caches trainable weights' casts only; the block's saved
                         tensors, that copy among them, are dropped and made again in backward)
    activations          the tensors autograd saves for backward, per sample, times the micro-batch

With adapters (LoRA) the trainable parameters are the adapters (and ``modules_to_save``),
counted on the wrapped model itself (:meth:`ModelMemory.of`): gradients, optimizer state,
DDP buckets and the checkpoint are theirs only. The adapter terms are held to real runs of
the tiny Llama, full fine-tune against LoRA (``tests/doctor/test_adapter_memory.py``).

Under FSDP2 (``distributed.strategy: fsdp``, :class:`Sharding`) weights, gradients,
optimizer state and the EMA are divided by the shard group (every rank: FSDP2 shards
over the world), there are no DDP buckets and no autocast copies (the mixed-precision
policy all-gathers the weights in bf16, which is the compute copy), and a rank also
holds what it gathers for the step (:func:`unsharded_bytes`)::

    gathered             the root group (parameters outside every block: embeddings, head)
                         for the whole forward and backward, the largest block twice (the
                         one computing and an all-gather buffer), in the compute dtype
    reduce-scatter       a block's unsharded gradient, and the previous block's in the reduce
                         dtype; the root's gradients, which its backward makes first
    accumulation         accumulating without a reduce-scatter per micro-step: every
                         parameter's unsharded gradient, in the reduce dtype, between micro-steps
    host (cpu_offload)   the sharded weights, gradients, optimizer state and EMA live in
                         host memory instead (:attr:`MemoryBreakdown.host_bytes`)

The FSDP terms are held to a real two-process run (``tests/doctor/test_fsdp_memory.py``):
the shards to the byte, what is gathered within :func:`unsharded_bytes`.

An estimate: allocator fragmentation, cuBLAS/cuDNN workspaces and the CUDA context take
the rest of a GPU, hence :data:`MEMORY_HEADROOM`. Torch-free arithmetic; the trace itself
is :func:`skylift.doctor.memory.trace_model_memory`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MEMORY_HEADROOM",
    "MEMORY_TIER_COPIES",
    "MemoryBreakdown",
    "ModelMemory",
    "Sharding",
    "fits_device",
    "memory_tier_bytes",
    "nf4_bytes_per_parameter",
    "optimizer_state_copies",
    "training_memory",
    "unsharded_bytes",
]

MEMORY_HEADROOM = 0.9
"""Share of a device's memory a job fits in (the CUDA context and fragmentation take the rest)."""

_FP32_BYTES = 4
_HALF_BYTES = 2


NF4_BLOCK_SIZE = 64
"""Weights per quantisation block: bitsandbytes' ``quantize_4bit(..., blocksize=64)`` default
(``bitsandbytes/functional.py``), which ``Linear4bit``/``Params4bit`` and transformers'
``BitsAndBytesConfig`` keep (``bnb_4bit_blocksize`` is not a setting there)."""
NF4_NESTED_BLOCK_SIZE = 256
"""Absmax values per second-level block under double quantisation: ``quantize_4bit`` with
``compress_statistics=True`` calls ``quantize_blockwise(absmax, blocksize=256)``."""


def nf4_bytes_per_parameter(*, double_quantization: bool = False) -> float:
    """Device bytes of one weight held in bitsandbytes' 4-bit NF4, its constants included.

    Two 4-bit codes a byte (0.5 B), and per block of :data:`NF4_BLOCK_SIZE` weights one
    absmax in fp32 (``quantize_4bit`` allocates ``absmax`` as ``float32``, one per block):
    ``0.5 + 4 / 64 = 0.5625`` B. With double quantisation (``compress_statistics=True``,
    transformers' ``bnb_4bit_use_double_quant``, whose default is False) the absmax values
    are themselves quantised to 8 bits (1 B per block) with one fp32 constant per 256 of
    them: ``0.5 + 1 / 64 + 4 / (64 x 256) = 0.51587`` B (one fp32 offset per tensor
    besides, negligible). The 256-entry codebooks are per tensor, negligible too.
    """
    if double_quantization:
        return 0.5 + 1 / NF4_BLOCK_SIZE + _FP32_BYTES / (NF4_BLOCK_SIZE * NF4_NESTED_BLOCK_SIZE)
    return 0.5 + _FP32_BYTES / NF4_BLOCK_SIZE


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


def _group_sizes(module: Any, blocks: Iterable[Any]) -> tuple[list[int], int]:
    """Parameters of each block's FSDP group (those no block below it took, as
    ``fully_shard`` assigns them) and of the root group (the rest)."""
    taken: set[int] = set()
    sizes = []
    for block in blocks:
        own = [p for p in block.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        sizes.append(sum(p.numel() for p in own))
    root = sum(p.numel() for p in module.parameters() if id(p) not in taken)
    return sizes, root


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
    block_count: int = 0
    """FSDP blocks (:func:`skylift.train.sharding.select_blocks`); 0: not counted, or none found."""
    largest_block_parameters: int = 0
    """Parameters of the largest block's FSDP group."""
    root_parameters: int | None = None
    """Parameters in no block (the root group, gathered for the whole step); ``None``:
    blocks not counted, so all of them count as the root's."""
    frozen_weight_bytes: int | None = None
    """Bytes the frozen parameters (``requires_grad`` False: a LoRA base) are stored in, at
    their dtype or in 4-bit NF4; ``None``: 4 each (fp32), as a model built by hand says."""
    quantized_parameters: int = 0
    """Frozen parameters held in bitsandbytes' 4-bit NF4 (``recipe.lora.quantize_base``)."""
    recomputed_frozen_parameters: int = 0
    """Frozen full-precision parameters inside activation-checkpointed blocks: their autocast
    copy goes with the block's saved tensors (autocast caches the casts of trainable leaves
    only, ``cached_cast`` in ``aten/src/ATen/autocast_mode.cpp``), so none is kept."""
    adapters: str | None = None
    """What trains instead of the whole model, in words ("LoRA", "QLoRA ..."); ``None``: every weight."""
    checkpoint_in_memory: bool = False
    """``checkpoint.memory``: the node's checkpoints in host memory (:func:`memory_tier_bytes`)."""
    reference_weight_bytes: int = 0
    """DPO's frozen reference copy (``recipe.dpo.reference: frozen_copy``): every weight
    again as stored, never trained (sharded as the policy under FSDP); 0 with adapters, whose reference is the
    base itself with the adapters off."""

    @property
    def frozen_parameters(self) -> int:
        return self.parameters - self.trainable_parameters

    @property
    def weight_bytes(self) -> int:
        """Every weight as held: the trainable ones in fp32, the frozen ones as stored."""
        frozen = self.frozen_parameters * _FP32_BYTES if self.frozen_weight_bytes is None else self.frozen_weight_bytes
        return self.trainable_parameters * _FP32_BYTES + frozen

    @classmethod
    def of(cls, module: Any, optim: Any, *, blocks: Iterable[Any] | None = None, quantized: Iterable[Any] = (),
           double_quantization: bool = False, adapters: str | None = None,
           recomputed: Iterable[Any] = (), **traced: Any) -> ModelMemory:
        """The counts of a ``torch.nn.Module`` (on meta or a device) trained with the
        ``optim`` config section; ``blocks``: its FSDP blocks, innermost first
        (:func:`skylift.train.sharding.select_blocks`), to size what sharded training
        gathers; ``quantized``: its frozen parameters that training holds in 4-bit NF4
        (:func:`nf4_bytes_per_parameter`), where the module itself still holds them at
        their dtype (a meta build); ``recomputed``: its activation-checkpointed blocks;
        ``traced``: the saved-tensor fields, where traced.

        Trainable and frozen are the module's own ``requires_grad``: after PEFT wraps a
        model, its adapters (and ``modules_to_save``) train and the base is frozen."""
        parameters = list(module.parameters())
        grouped: dict[str, Any] = {}
        if blocks is not None:
            sizes, root = _group_sizes(module, blocks)
            grouped = {"block_count": len(sizes), "largest_block_parameters": max(sizes, default=0),
                       "root_parameters": root}  # fmt: skip
        four_bit = {id(p) for p in quantized}
        nf4 = nf4_bytes_per_parameter(double_quantization=double_quantization)
        frozen = [p for p in parameters if not p.requires_grad]
        frozen_bytes = sum(p.numel() * nf4 if id(p) in four_bit else p.numel() * p.element_size() for p in frozen)
        in_blocks = {id(p): p for block in recomputed for p in block.parameters()}
        recomputed_frozen = sum(p.numel() for p in in_blocks.values() if not p.requires_grad and id(p) not in four_bit)
        return cls(
            parameters=sum(p.numel() for p in parameters),
            trainable_parameters=sum(p.numel() for p in parameters if p.requires_grad),
            buffer_elements=sum(b.numel() for b in module.buffers()),
            optimizer_state_copies=optimizer_state_copies(optim.name, optim.momentum),
            ema=optim.ema_decay is not None,
            frozen_weight_bytes=round(frozen_bytes),
            quantized_parameters=sum(p.numel() for p in frozen if id(p) in four_bit),
            recomputed_frozen_parameters=recomputed_frozen,
            adapters=adapters,
            **grouped,
            **traced,
        )


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """FSDP2 as the job configures it (``distributed.strategy: fsdp``)."""

    shard_count: int
    """Ranks the state is split over: every rank (FSDP2 on a one-dimensional mesh)."""
    reshard_after_forward: bool = True
    """``distributed.fsdp.reshard_after_forward``: False keeps every block gathered from
    its forward to its backward."""
    cpu_offload: bool = False
    """``distributed.fsdp.cpu_offload``: the sharded state lives in host memory."""
    reduce_bytes: int = _FP32_BYTES
    """Bytes per gradient element of the reduce-scatter (``distributed.fsdp.reduce_dtype``)."""
    reduce_every_micro_step: bool = False
    """Reduce-scatter after every micro-step of an accumulated step. False (skylift's
    Trainer): once per optimizer step, so between micro-steps FSDP2 keeps each
    parameter's unsharded gradient in the reduce dtype (``set_requires_gradient_sync``)."""

    def __post_init__(self) -> None:
        if self.shard_count < 1:
            raise ValueError(f"shard_count {self.shard_count} must be >= 1")

    @classmethod
    def of(cls, distributed: Any, world_size: int) -> Sharding | None:
        """From the ``distributed`` config section; ``None`` under ``strategy: ddp``."""
        if distributed.strategy != "fsdp":
            return None
        fsdp = distributed.fsdp
        reduce_bytes = _HALF_BYTES if fsdp.reduce_dtype == "bf16" else _FP32_BYTES
        return cls(shard_count=world_size, reshard_after_forward=fsdp.reshard_after_forward,
                   cpu_offload=fsdp.cpu_offload, reduce_bytes=reduce_bytes)  # fmt: skip

    def describe(self) -> str:
        """The words doctor and plan print: "sharded over N ranks" and what moves where."""
        text = f"sharded over {self.shard_count} rank{'s' if self.shard_count != 1 else ''} (FSDP2)"
        return text + (", sharded state offloaded to host memory" if self.cpu_offload else "")


def unsharded_bytes(model: ModelMemory, sharding: Sharding, *, half_precision: bool,
                    accumulating: bool = False) -> int:  # fmt: skip
    """What a rank gathers during a sharded step, beside its shards: the most of three
    moments, each an upper bound while the activations are alive.

    FSDP2 all-gathers a group's parameters into a flat buffer, copies them out into the
    parameters (the compute dtype) and frees the buffer only after the next group copies
    its own out (torch ``_fsdp_param_group.py``, "[Note: Overlapping all-gather copy-in
    and all-gather]"); backward prefetches the next block by default
    (``_backward_prefetch``). The root group (parameters in no block: embeddings, head) is
    gathered for the whole forward (the root's pre-forward wraps it) and the whole backward
    (the root's post-backward comes last). So, with ``R`` root and ``B`` largest-block
    parameters, ``c`` and ``r`` the compute and reduce bytes::

        forward    c x (R + B + max(R, B))        the root, the block computing, the previous
                                                  group's buffer (the root's, at the first block)
        backward   c x (R + 2B) + c x B + r x B   as forward, its unsharded gradient, the previous
                   + c x R                        block's reduce-scatter input, and the root's
                                                  gradients (the head's come first)
        end        c x R + r x R                  the root's gradients and its reduce-scatter input

    Without ``reshard_after_forward`` every block stays gathered from its forward to its
    backward (``R + B`` becomes every parameter). Accumulating without a reduce-scatter
    per micro-step adds every parameter's unsharded gradient in the reduce dtype. Where
    ``model`` has no blocks counted, every parameter is the root's.
    """
    compute, reduce = (_HALF_BYTES if half_precision else _FP32_BYTES), sharding.reduce_bytes
    root = model.parameters if model.root_parameters is None else model.root_parameters
    block = model.largest_block_parameters
    held = root + block if sharding.reshard_after_forward else model.parameters
    forward = compute * (held + max(root, block))
    backward = compute * (held + 2 * block + root) + reduce * block
    end = (compute + reduce) * root
    accumulated = model.trainable_parameters * reduce if accumulating and not sharding.reduce_every_micro_step else 0
    return max(forward, backward, end) + accumulated


MEMORY_TIER_COPIES = 3
"""Steps ``checkpoint.memory`` holds in a node's memory at its peak: the newest two
committed and the one being written (skylift.checkpoint.memory_tier)."""


def memory_tier_bytes(checkpoint_bytes_per_rank: int, *, sharded: bool, ranks_per_node: int, nodes: int) -> int:
    """Host memory ``checkpoint.memory`` takes on one node: :data:`MEMORY_TIER_COPIES`
    steps of the node's share and of its ring predecessor's.

    A node's share is its ranks' shards under FSDP, the whole (replicated) state under
    DDP, which every node writes itself, so a peer then sends only a few per-rank files.

    Example:
        >>> memory_tier_bytes(100, sharded=True, ranks_per_node=8, nodes=2)
        4800
        >>> memory_tier_bytes(800, sharded=False, ranks_per_node=8, nodes=2)
        2400
    """
    node = checkpoint_bytes_per_rank * ranks_per_node if sharded else checkpoint_bytes_per_rank
    peer = node if sharded and nodes > 1 else 0
    return MEMORY_TIER_COPIES * (node + peer)


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
    shard_count: int = 1
    """Ranks the weights, gradients and optimizer state are split over (1: DDP, each rank holds all)."""
    unsharded_bytes: int = 0
    """FSDP: what the rank gathers for the step (:func:`unsharded_bytes`)."""
    offloaded: bool = False
    """FSDP ``cpu_offload``: the (sharded) weights, gradients, optimizer state and EMA are
    in host memory, not on the device."""
    frozen_weight_bytes: int = 0
    """The part of ``parameter_bytes`` that is frozen (a LoRA base): no gradient, no
    optimizer state, and not in a checkpoint (which holds the adapters)."""
    reference_bytes: int = 0
    """DPO's frozen reference copy of the weights (:attr:`ModelMemory.reference_weight_bytes`):
    whole on every rank under DDP, this rank's shard of it under FSDP."""

    @property
    def sharded_state_bytes(self) -> int:
        """Weights, gradients, optimizer state and EMA: what sharding divides and offload moves."""
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_state_bytes + self.ema_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory the rank's offloaded state takes (0 without ``cpu_offload``)."""
        return self.sharded_state_bytes if self.offloaded else 0

    @property
    def state_bytes(self) -> int:
        """Everything on the device but the activations: what a micro-batch of any size adds to."""
        on_device = 0 if self.offloaded else self.sharded_state_bytes
        return on_device + self.bucket_bytes + self.autocast_weight_bytes + self.unsharded_bytes + self.reference_bytes

    @property
    def total_bytes(self) -> int:
        """The device peak (host memory apart: :attr:`host_bytes`)."""
        return self.state_bytes + (self.activation_bytes or 0)

    def fits(self, device_memory_bytes: float) -> bool:
        """Whether the whole peak fits the device (:func:`fits_device`)."""
        return fits_device(self.total_bytes, device_memory_bytes)


def training_memory(model: ModelMemory, micro_batch_size: int, *, half_precision: bool, world_size: int,
                    shard_count: int = 1, sharding: Sharding | None = None,
                    accumulating: bool = False) -> MemoryBreakdown:  # fmt: skip
    """One rank's peak memory training ``model`` on micro-batches of ``micro_batch_size``.

    Args:
        half_precision: bf16/fp16 autocast, or FSDP's bf16 parameters (activations and
            the compute copy of the weights at 2 bytes).
        world_size: ranks; above 1, DDP's gradient buckets count.
        shard_count: ranks the weights, gradients and optimizer state are split over
            (sharded data parallel); 1: each rank holds all of them. Shorthand for
            ``sharding=Sharding(shard_count=...)``.
        sharding: FSDP2's settings (``None``: DDP, unless ``shard_count`` > 1).
        accumulating: the step accumulates several micro-steps (FSDP: unsharded
            gradients between them, unless :attr:`Sharding.reduce_every_micro_step`).

    Example:
        >>> model = ModelMemory(parameters=1000, trainable_parameters=1000, optimizer_state_copies=2,
        ...                     saved_float_elements_per_sample=10.0)
        >>> training_memory(model, 4, half_precision=False, world_size=1).total_bytes
        16160
    """
    if micro_batch_size < 0 or world_size < 1 or shard_count < 1:
        raise ValueError(f"micro_batch_size {micro_batch_size}, world_size {world_size} and shard_count "
                         f"{shard_count} must be >= 0, >= 1 and >= 1")
    if sharding is None and shard_count > 1:
        sharding = Sharding(shard_count=shard_count)
    shards = sharding.shard_count if sharding else 1
    trainable = model.trainable_parameters * _FP32_BYTES
    activations = None
    if model.saved_float_elements_per_sample is not None:
        element_bytes = _HALF_BYTES if half_precision else _FP32_BYTES
        per_sample = model.saved_float_elements_per_sample * element_bytes + model.saved_other_bytes_per_sample
        activations = round(per_sample * micro_batch_size)
    # FSDP's EMA averages the sharded weights (buffers stay whole on every rank).
    ema_bytes = model.weight_bytes // shards + model.buffer_elements * _FP32_BYTES if model.ema else 0
    # Autocast casts every floating weight a layer uses, frozen ones too, and backward keeps the
    # copy (a frozen layer still passes the gradient to its input); a 4-bit weight is dequantised
    # per call instead, and a frozen weight in a recomputed block is cast again in backward.
    cast = model.parameters - model.quantized_parameters - model.recomputed_frozen_parameters
    return MemoryBreakdown(
        micro_batch_size=micro_batch_size,
        parameter_bytes=model.weight_bytes // shards,
        gradient_bytes=trainable // shards,
        optimizer_state_bytes=trainable * model.optimizer_state_copies // shards,
        bucket_bytes=trainable if world_size > 1 and sharding is None else 0,
        ema_bytes=ema_bytes,
        autocast_weight_bytes=cast * _HALF_BYTES if half_precision and sharding is None else 0,
        frozen_weight_bytes=(model.weight_bytes - trainable) // shards,
        reference_bytes=model.reference_weight_bytes // shards,  # FSDP shards the frozen copy as the policy
        activation_bytes=activations,
        shard_count=shards,
        unsharded_bytes=unsharded_bytes(model, sharding, half_precision=half_precision,
                                        accumulating=accumulating) if sharding else 0,
        offloaded=bool(sharding and sharding.cpu_offload),
    )

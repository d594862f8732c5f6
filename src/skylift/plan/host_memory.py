"""What a node's RAM must hold besides the GPUs' work: FSDP's ``cpu_offload`` shards and
``checkpoint.memory``'s copies (:func:`skylift.machine.memory.memory_tier_bytes`)."""

from __future__ import annotations

from skylift.machine.memory import MEMORY_HEADROOM, MemoryBreakdown, ModelMemory, memory_tier_bytes

__all__ = ["host_overflow"]


def host_overflow(breakdown: MemoryBreakdown, memory: ModelMemory, *, ranks_per_node: int, nodes: int,
                  host_memory_bytes: float | None) -> str | None:
    """Why the node's RAM cannot hold what ``cpu_offload`` and ``checkpoint.memory`` put
    there, if it cannot."""
    offloaded = breakdown.host_bytes * ranks_per_node
    tier = 0
    if memory.checkpoint_in_memory:
        per_rank = breakdown.parameter_bytes - breakdown.frozen_weight_bytes + breakdown.optimizer_state_bytes
        tier = memory_tier_bytes(per_rank, sharded=breakdown.shard_count > 1, ranks_per_node=ranks_per_node,
                                 nodes=nodes)  # fmt: skip
    needed = offloaded + tier
    if not needed or host_memory_bytes is None or needed <= MEMORY_HEADROOM * host_memory_bytes:
        return None
    parts = [f"{ranks_per_node} ranks' offloaded state {offloaded / 2**30:.1f} GiB"] if offloaded else []
    parts += [f"checkpoint.memory's copies {tier / 2**30:.1f} GiB"] if tier else []
    return (f"does not fit: {' + '.join(parts)} > {MEMORY_HEADROOM * host_memory_bytes / 2**30:.1f} GiB of "
            "the node's RAM usable")

"""The plan's communication term under FSDP2 (``distributed.strategy: fsdp``).

Per micro-step a sharded step all-gathers every group's parameters in forward and, with
``reshard_after_forward``, again in backward; once per optimizer step (or every
micro-step with :attr:`~skylift.machine.memory.Sharding.reduce_every_micro_step`) it
reduce-scatters the gradients. On ``n`` ranks a ring all-gather or reduce-scatter of
``S`` bytes takes ``(n - 1) / n x S / bus bandwidth``, half a ring all-reduce (which is a
reduce-scatter then an all-gather: NCCL's ``nccl-tests`` PERFORMANCE.md gives the bus
factors ``2(n-1)/n`` and ``(n-1)/n``); between nodes the same two-level sum as the DDP
term. Bytes per optimizer step, ``P`` parameters, ``A`` micro-steps::

    all-gather     A x (1 + reshard_after_forward) x P x compute bytes (2 under bf16, else 4)
    reduce-scatter (1, or A) x P x reduce bytes (distributed.fsdp.reduce_dtype)

In fp32 that is 1.5x DDP's all-reduce of the gradients (ZeRO stage 3's figure:
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", arXiv:1910.02054, its communication analysis); with bf16 parameters and fp32
reduction, DDP's bytes.
skylift's Trainer gives the root the same ``reshard_after_forward`` as the blocks
(:mod:`skylift.train.sharding`), so the root group is gathered again in backward too.

Overlap, as FSDP2 schedules it: the all-gather of block ``i+1`` runs under the compute of
block ``i`` (forward: implicit prefetch on the all-gather stream; backward: the default
one-block prefetch, ``_backward_prefetch`` in torch's ``_fsdp_param_group.py``), and block
``i``'s reduce-scatter under block ``i-1``'s backward (Zhao et al., "PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", VLDB 2023, arXiv:2304.11277). With
``L`` blocks of equal size, forward a third and backward two thirds of the compute (backward
does twice forward's FLOPs), the exposed time per micro-step is::

    forward   AG(root) + AG(block) + (L - 1) x max(0, AG(block) - forward / L)
    backward  AG(root) + AG(block) + (L - 1) x max(0, AG(block) + RS(block) - backward / L)
              + RS(block) + RS(root)

(the first gathers come before any compute, the last reduce-scatters after it; AGs in
backward only with ``reshard_after_forward``, RS only on a micro-step that syncs). The
compute is the one the DDP term (:mod:`skylift.plan.ddp`) hides its bucketed all-reduce
under: on a GPU, the GPU model's forward + backward with its in-node scaling
(:mod:`skylift.plan.gpu_compute`); both terms overlap by the same one-third/two-thirds
split of forward and backward. On a CPU nothing overlaps: gloo's collectives run on the cores the compute uses, so the
whole communication counts, as the DDP term counts its all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skylift.machine.memory import ModelMemory, Sharding

__all__ = ["ShardedCommunication", "sharded_communication"]

_FORWARD_SHARE = 1 / 3
"""Forward's share of forward + backward: backward computes the gradients of the inputs
and of the weights, twice forward's FLOPs (the 2N + 4N FLOPs per token of Kaplan et al.
2020); activation checkpointing's recomputation is counted in backward's share."""


@dataclass(frozen=True, kw_only=True)
class ShardedCommunication:
    """One optimizer step's collectives under FSDP2, on one target."""

    bytes_per_step: float
    """Bytes the collectives carry, each at its full tensor's size (all-gathers + reduce-scatters)."""
    total_s: float
    """Every collective back to back."""
    exposed_s: float
    """What the compute does not hide (the ``communication`` part of the step)."""


def sharded_communication(*, parameters: int, memory: ModelMemory | None, sharding: Sharding,
                          links: Sequence[tuple[int, float | None]], overlaps: bool, compute_s: float,
                          accumulation_steps: int, half_precision: bool) -> ShardedCommunication:  # fmt: skip
    """The step's all-gathers and reduce-scatters, and what ``compute_s`` (the step's
    forward + backward on the target) hides of them.

    Args:
        parameters: the model's parameter count.
        memory: its FSDP groups (:class:`~skylift.machine.memory.ModelMemory`: blocks and
            root); ``None`` or no blocks counted: one group, nothing to overlap with.
        links: ``(ranks, bus bytes/s)`` of each level the ring crosses: the ranks of a
            node, then the nodes (a level of one rank, or without a bandwidth, costs nothing).
        overlaps: the collectives run beside the compute (a GPU's streams; not a CPU's gloo).
    """
    root_parameters = memory.root_parameters if memory is not None else None
    blocks = memory.block_count if memory is not None and root_parameters is not None else 0
    root = root_parameters if blocks and root_parameters is not None else parameters
    block = (parameters - root) / blocks if blocks else 0.0
    compute_bytes = 2 if half_precision else 4
    seconds = _collective_seconds(links)
    overlaps = overlaps and blocks > 1
    per_block_forward_s = compute_s / accumulation_steps * _FORWARD_SHARE / max(blocks, 1)
    per_block_backward_s = compute_s / accumulation_steps * (1 - _FORWARD_SHARE) / max(blocks, 1)
    gather_root, gather_block = seconds(root * compute_bytes), seconds(block * compute_bytes)
    regather_root, regather_block = (gather_root, gather_block) if sharding.reshard_after_forward else (0.0, 0.0)
    gathered = parameters * (1 + sharding.reshard_after_forward)
    total = exposed = moved = 0.0
    for micro_step in range(accumulation_steps):
        syncs = sharding.reduce_every_micro_step or micro_step == accumulation_steps - 1
        scatter_root = seconds(root * sharding.reduce_bytes) if syncs else 0.0
        scatter_block = seconds(block * sharding.reduce_bytes) if syncs else 0.0
        step_total = (gather_root + regather_root + scatter_root
                      + blocks * (gather_block + regather_block + scatter_block))  # fmt: skip
        total += step_total
        moved += gathered * compute_bytes + (parameters * sharding.reduce_bytes if syncs else 0.0)
        if not overlaps:
            exposed += step_total
            continue
        forward = gather_root + gather_block + (blocks - 1) * max(0.0, gather_block - per_block_forward_s)
        backward = (regather_root + regather_block + scatter_block + scatter_root
                    + (blocks - 1) * max(0.0, regather_block + scatter_block - per_block_backward_s))  # fmt: skip
        exposed += forward + backward
    return ShardedCommunication(bytes_per_step=moved, total_s=total, exposed_s=exposed)


def _collective_seconds(links: Sequence[tuple[int, float | None]]) -> Callable[[float], float]:
    """Seconds of a ring all-gather (or reduce-scatter) of a tensor of ``size`` bytes over
    ``links``: each level of the ring moves ``(n - 1) / n`` of it."""

    def seconds(size: float) -> float:
        return sum((ranks - 1) / ranks * size / bus_bytes_per_s for ranks, bus_bytes_per_s in links
                   if ranks > 1 and bus_bytes_per_s)  # fmt: skip

    return seconds

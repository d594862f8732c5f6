"""The plan's communication term under DDP: the gradient all-reduce, overlapped with backward.

DDP groups the gradients into buckets (``bucket_cap_mb``, 25 MiB by default) in reverse
order of the forward, and starts each bucket's all-reduce as soon as backward has
produced every gradient in it, on a separate stream (Li et al., "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB 2020, arXiv:2006.15704). So
on a GPU all but the last bucket run under the rest of backward; what is exposed per
optimizer step is::

    exposed = AR(last bucket) + max(0, AR(all) - AR(last bucket) - backward)

with ``AR(x) = 2 (n - 1) / n x bytes / bus bandwidth`` per level of the ring (NCCL's
``nccl-tests`` PERFORMANCE.md) and backward two thirds of forward + backward (it
computes the gradients of the inputs and of the weights: twice forward's FLOPs). The
step is *compute-bound* while the all-reduce fits under backward (the exposed part is
then one bucket), *communication-bound* once it outlasts it. With accumulation only
the last micro-step syncs (``no_sync`` on the others), so backward here is that
micro-step's. On a CPU nothing overlaps: gloo's all-reduce runs on the cores the
compute uses, so the whole all-reduce counts (as the FSDP term counts it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["BACKWARD_SHARE", "BUCKET_BYTES", "DdpCommunication", "ddp_communication"]

BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb`` (25 MiB); the first bucket is 1 MiB in torch, which
only moves more of the work under backward."""

BACKWARD_SHARE = 2 / 3
"""Backward's share of forward + backward (the 2N + 4N FLOPs per token of Kaplan et al. 2020)."""


@dataclass(frozen=True, kw_only=True)
class DdpCommunication:
    """One optimizer step's gradient all-reduce on one target."""

    total_s: float
    """The whole all-reduce, back to back."""
    exposed_s: float
    """What backward does not hide (the ``communication`` part of the step)."""
    backward_s: float
    """The backward it overlaps with (the last micro-step's)."""

    @property
    def bound(self) -> str:
        """``compute-bound`` when the all-reduce fits under backward, else ``communication-bound``."""
        return "communication-bound" if self.total_s > self.backward_s else "compute-bound"


def ddp_communication(*, gradient_bytes: float, links: Sequence[tuple[int, float | None]], overlaps: bool,
                      compute_s: float, accumulation_steps: int) -> DdpCommunication:  # fmt: skip
    """The all-reduce of ``gradient_bytes`` over ``links`` (``(ranks, bus bytes/s)`` per
    level: the ranks of a node, then the nodes) and what ``compute_s`` (the step's
    forward + backward on the target) hides of it."""

    def seconds(size: float) -> float:
        return sum(2 * (ranks - 1) / ranks * size / bus_bytes_per_s for ranks, bus_bytes_per_s in links
                   if ranks > 1 and bus_bytes_per_s)  # fmt: skip

    total = seconds(gradient_bytes)
    backward = compute_s / max(accumulation_steps, 1) * BACKWARD_SHARE
    if not overlaps:
        return DdpCommunication(total_s=total, exposed_s=total, backward_s=0.0)
    last_bucket = seconds(min(gradient_bytes, BUCKET_BYTES))
    exposed = last_bucket + max(0.0, total - last_bucket - backward)
    return DdpCommunication(total_s=total, exposed_s=exposed, backward_s=backward)

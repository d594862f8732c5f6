"""Memory traffic and FLOPs of one training step, op by op, traced on the ``meta`` device.

Every ATen op of one forward + backward is seen by a dispatch mode: its FLOPs come
from PyTorch's own formulas (:mod:`torch.utils.flop_counter`, the ones MFU uses), its
bytes are those of the tensors it reads and writes. Views (reshapes, transposes,
slices, ``detach``) move nothing and launch nothing: they are left out of both. That
byte count is the traffic of an unfused execution (each op reads its inputs from memory and writes its output
back); fusion and caches make the real figure smaller, so it is an upper bound.

Ops split into two classes by that trace: ``compute`` ops with a FLOP formula
(matmuls, convolutions, attention) and ``memory`` ops without (elementwise, norms,
pooling, copies), whose time follows memory bandwidth rather than peak FLOP/s. The
planner uses the split to scale a measured step to a machine with another ratio of
compute to bandwidth (a two-class roofline).

Shapes only, no arithmetic: seconds even for a ResNet-50, the same on any CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = ["StepTraffic", "trace_model_traffic", "trace_step_traffic"]

_HALF_BYTES = 2


@dataclass(frozen=True)
class StepTraffic:
    """Per sample of one forward + backward (optimizer excluded)."""

    bytes_per_sample: float
    """All ops' tensor reads and writes (unfused upper bound)."""
    memory_op_bytes_per_sample: float
    """The part of it moved by ops without FLOPs (bandwidth-bound)."""
    compute_op_bytes_per_sample: float
    flops_per_sample: float
    ops: int
    conv_flops_per_sample: float = 0.0
    """The part of ``flops_per_sample`` in convolutions (forward and backward): the
    planner's GPU model tells convolutional from GEMM-heavy work by it."""
    intensity_bins: tuple[tuple[float, float, float], ...] = ()
    """The ops with FLOPs grouped by arithmetic intensity (half-octaves of FLOP/byte):
    per group ``(FLOPs, bytes, bytes of convolutions)`` per sample, so a GPU model can
    put each group on its side of the roofline (:mod:`skylift.plan.calibration`)."""


def trace_step_traffic(config: RunConfig, micro_batch_size: int, *, half: bool) -> StepTraffic:
    """Trace one micro-batch of ``micro_batch_size`` samples (weights are read once per
    micro-batch, so the per-sample figure depends on it) of ``config``'s model and loss.

    ``half``: floating tensors count 2 bytes, as where the job trains in bf16/fp16
    (autocast computes and stores activations in half precision).

    Raises:
        ValueError: the model cannot be traced on meta (an op without a meta kernel, or
            streamed data whose sample shape is unknown before the first shard).
    """
    from skylift.doctor.memory import meta_model_and_batch

    model, batch, loss_fn = meta_model_and_batch(config, micro_batch_size)
    return trace_model_traffic(model, batch, loss_fn, micro_batch_size, half=half)


def trace_model_traffic(model: Any, batch: Any, loss_fn: Any, micro_batch_size: int, *, half: bool) -> StepTraffic:
    """:func:`trace_step_traffic` of a model already built on meta: ``loss_fn(model,
    batch)`` is one micro-batch's loss (a published workload skylift traces outside a
    recipe, :mod:`skylift.plan.published_trace`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    totals = {"compute": 0.0, "memory": 0.0, "flops": 0.0, "conv_flops": 0.0, "ops": 0}
    convolutions = {torch.ops.aten.convolution, torch.ops.aten.convolution_backward}
    # Aliases their schema does not mark as views (matmul's reshapes of contiguous tensors).
    views = {torch.ops.aten._unsafe_view, torch.ops.aten.alias, torch.ops.aten.lift_fresh}
    bins: dict[float, list[float]] = {}

    def size(tensor: torch.Tensor) -> int:
        element = _HALF_BYTES if half and tensor.is_floating_point() else tensor.element_size()
        return tensor.numel() * element

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.is_view or func._overloadpacket in views:
                return out  # a new view of the same storage: no kernel runs, no byte moves
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            moved = sum(size(t) for t in tensors)
            formula = flop_registry.get(func._overloadpacket)
            flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
            totals["compute" if flops else "memory"] += moved
            totals["flops"] += flops
            if func._overloadpacket in convolutions:
                totals["conv_flops"] += flops
            if flops:
                group = bins.setdefault(round(2 * math.log2(flops / max(moved, 1))) / 2, [0.0, 0.0, 0.0])
                group[0], group[1] = group[0] + flops, group[1] + moved
                group[2] += moved if func._overloadpacket in convolutions else 0.0
            totals["ops"] += 1
            return out

    try:
        with Counter():
            loss_fn(model, batch).backward()
    except Exception as error:  # noqa: BLE001 - reported as the reason the figure is missing
        raise ValueError(f"{type(error).__name__}: {error}") from None
    per = float(micro_batch_size)
    return StepTraffic(
        bytes_per_sample=(totals["compute"] + totals["memory"]) / per,
        memory_op_bytes_per_sample=totals["memory"] / per,
        compute_op_bytes_per_sample=totals["compute"] / per,
        flops_per_sample=totals["flops"] / per,
        ops=int(totals["ops"]),
        conv_flops_per_sample=totals["conv_flops"] / per,
        intensity_bins=tuple(_per_sample(bins[key], per) for key in sorted(bins)),
    )


def _per_sample(group: list[float], samples: float) -> tuple[float, float, float]:
    """One intensity bin's (FLOPs, bytes moved, convolutions' bytes), per sample."""
    flops, moved, convolution_moved = group
    return flops / samples, moved / samples, convolution_moved / samples

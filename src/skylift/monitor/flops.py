"""Model FLOPs per step and the device's peak, the two halves of MFU.

FLOPs are counted once, with :class:`torch.utils.flop_counter.FlopCounterMode`, on a
copy of the training step whose parameters live on the ``meta`` device: no model
arithmetic, no gradients or buffers of the real model touched, the random state
restored (so a resumed run stays bitwise equal to an uninterrupted one).

Peaks are dense (no 2:4 sparsity) per-GPU figures from NVIDIA's data sheets; on a
CPU the peak is measured with matmuls in the run's dtype, per CPU-second and cached per
machine (:mod:`skylift.monitor.cpu_peak`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from skylift.machine.gpus import gpu_spec
from skylift.monitor.cpu_peak import measure_cpu_peak_flops

__all__ = [
    "Peak", "SequenceFlops", "count_step_flops", "device_peak", "explain_step_flops", "fit_sequence_flops",
    "measure_cpu_peak_flops", "padded_shape",
]

log = logging.getLogger("skylift")


@dataclass(frozen=True)
class Peak:
    flops_per_s: float | None
    """Peak of one device, or ``None`` when unknown."""
    source: str
    """``table:<entry>``, ``measured:cpu-matmul``, or ``unknown: <why>``."""


def device_peak(device: torch.device, precision: str) -> Peak:
    """The peak FLOP/s of one device at ``precision`` (``fp32``, ``tf32``, ``fp16``, ``bf16``)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return gpu_peak(name, precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return Peak(measure_cpu_peak_flops(dtype), f"measured:cpu-matmul-{str(dtype).removeprefix('torch.')}")


def gpu_peak(name: str, precision: str) -> Peak:
    spec = gpu_spec(name)
    if spec is None:
        return Peak(None, f"unknown: GPU {name!r} is not in skylift's data-sheet table (skylift.machine.gpus)")
    return Peak(spec.peak_flops_per_s(precision), f"table:{spec.table_entry}")


def count_step_flops(
    module: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]
) -> float | None:
    """FLOPs of forward + backward of ``loss_fn(module, batch)`` for one micro-batch.

    Returns ``None`` when they cannot be counted, and says why in a warning (see
    :func:`explain_step_flops` for the reason as a value).
    """
    flops, reason = explain_step_flops(module, batch, loss_fn)
    if flops is None:
        log.warning("FLOPs not counted, so no MFU: %s", reason)
    return flops


def explain_step_flops(
    module: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]
) -> tuple[float | None, str]:
    """``(FLOPs, "counted on meta")`` for one micro-batch, or ``(None, why not)``.

    Parameters and buffers are ``meta`` copies; the batch stays real (a clone), so a
    model that reads its inputs' values (Hugging Face's attention mask builders ask
    ``mask.all()`` to skip an all-ones mask) can: ops on the batch alone run for real
    (index and mask arithmetic, batch-sized), and any op that meets a meta tensor runs
    on meta, its real inputs moved there. A model that reads values of its
    activations (data-dependent routing) cannot be counted so: the reason names it.
    """
    from torch.utils.flop_counter import FlopCounterMode

    params = {name: _meta_like(p).requires_grad_(p.requires_grad) for name, p in module.named_parameters()}
    buffers = {name: _meta_like(b) for name, b in module.named_buffers()}
    # A clone: a loss that edits its batch in place must not edit the one training reads.
    real_batch = tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, batch)
    shadow = _Functional(module, {**params, **buffers})
    # Meta kernels draw no random numbers; the fork restores any a real op on the batch drew.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices), FlopCounterMode(display=False) as counter, _MetaWins():
            loss = loss_fn(shadow, real_batch)
            loss.backward()
    except Exception as error:  # noqa: BLE001 - an op without a meta kernel must not stop training
        return None, f"the step could not run on the meta device ({type(error).__name__}: {error})"
    total = float(counter.get_total_flops())
    if total <= 0:
        return None, "the step ran no matmul, convolution or attention (the ops FlopCounterMode counts)"
    return total, "counted on meta"


@dataclass(frozen=True)
class SequenceFlops:
    """Training FLOPs of one sequence padded to ``S`` tokens: ``per_token * S + per_token_pair * S**2 + fixed``.

    Exact for models whose counted ops are matmuls over a token axis (linear layers:
    ``S``), attention (``S**2``) and per-sequence heads (``fixed``), which is every
    BERT-family encoder and decoder: the three coefficients come from three exact
    counts, so the formula reproduces the count at every length.
    """

    per_token: Fraction
    per_token_pair: Fraction
    fixed: Fraction
    counted_lengths: tuple[int, int, int]

    def batch_flops(self, sequences: int, length: int) -> float:
        """FLOPs of a micro-batch of ``sequences`` sequences padded to ``length`` tokens."""
        return float(sequences * (self.per_token * length + self.per_token_pair * length**2 + self.fixed))

    def as_record(self) -> dict[str, Any]:
        return {"per_token": float(self.per_token), "per_token_pair": float(self.per_token_pair),
                "fixed": float(self.fixed), "counted_lengths": list(self.counted_lengths)}  # fmt: skip


def padded_shape(batch: Any) -> tuple[int, int] | None:
    """(sequences, padded length) of a text batch: its first two-dimensional tensor (the token ids)."""
    for value in tree_flatten(batch)[0]:
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return int(value.shape[0]), int(value.shape[1])
    return None


def fit_sequence_flops(
    module: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]
) -> tuple[SequenceFlops | None, str]:
    """Count ``batch`` cut to three lengths (every tensor of its padded length, cut on that
    axis) and solve for :class:`SequenceFlops`; ``(None, why not)`` when it cannot.

    Under a token budget every micro-batch has its own length, so FLOPs per sample of the
    first one would misstate the others (BERT at 29 and at 128 tokens: 2.2x apart).
    """
    shape = padded_shape(batch)
    if shape is None or shape[1] < 3:
        return None, f"no token axis to fit FLOPs over (first 2-D tensor's shape: {shape})"
    sequences, length = shape
    lengths = (length, max(1, length // 2), 1) if length >= 4 else (3, 2, 1)
    counts = []
    for cut in lengths:
        flops, reason = explain_step_flops(module, _cut(batch, length, cut), loss_fn)
        if flops is None:
            return None, reason
        counts.append(Fraction(int(flops), sequences))
    # Three equations c_i = a*L_i + b*L_i^2 + f in exact rationals (the counts are integers).
    (l1, l2, l3), (c1, c2, c3) = lengths, counts
    b = ((c1 - c2) / (l1 - l2) - (c2 - c3) / (l2 - l3)) / (l1 - l3)
    a = (c1 - c2) / (l1 - l2) - b * (l1 + l2)
    fixed = c1 - a * l1 - b * l1**2
    return SequenceFlops(a, b, fixed, lengths), "counted on meta at three lengths"


def _cut(batch: Any, length: int, cut: int) -> Any:
    def shorten(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            return value[:, :cut]
        return value

    return tree_map(shorten, batch)


class _MetaWins(TorchDispatchMode):
    """Runs an op on ``meta`` when any of its tensors is there, moving its real tensors
    along (the kernels refuse mixed devices); ops on real tensors only run as they are.
    A real tensor sent to the parameters' device (``mask.to(embeddings.device)``) stays
    real: the next op that meets a meta tensor moves it, and until then its values can
    still be read."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and not args[0].is_meta and _is_meta_device(kwargs.get("device")):
            kwargs = {key: value for key, value in kwargs.items() if key != "device"}
            return func(*args, **kwargs)
        tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if any(t.is_meta for t in tensors) and not all(t.is_meta for t in tensors):
            args, kwargs = tree_map(_to_meta, (args, kwargs))
        return func(*args, **kwargs)


def _is_meta_device(device: Any) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) and not value.is_meta else value


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")


class _Functional(nn.Module):
    """Calls ``module`` with replacement parameters, so the recipe's loss can run on meta."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._wrapped = [module]  # a list: not registered as a submodule
        self._tensors = tensors
        self.training = module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.func import functional_call

        return functional_call(self._wrapped[0], self._tensors, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._wrapped[0], name)

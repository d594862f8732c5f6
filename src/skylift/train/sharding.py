"""FSDP2 for ``distributed.strategy: fsdp``: which blocks are sharded, in which precision, and
the collectives sharding changes.

:class:`Sharding` applies ``torch.distributed.fsdp.fully_shard`` to each block and then to
the root, on a one-dimensional device mesh over every rank. Afterwards every parameter is a
``DTensor`` holding this rank's slice; each block gathers its full parameters just before
it runs and frees them after (``reshard_after_forward``), and gradients are
reduce-scattered, so each rank keeps only its slice of parameters, gradients and optimizer
state.

Three things that hold under DDP without thought need care here, and live in this module:

- the global gradient norm is a sum over every rank's slice (:func:`global_grad_norm`);
- the final weights are gathered from every rank before rank 0 writes them
  (:meth:`Sharding.full_state_dict`);
- evaluation runs a forward, a collective, on every rank as often as on every other
  (:func:`lockstep`).

A model built on the ``meta`` device is given memory for this rank's shards only and
filled from a folder of safetensors files, each rank reading its own rows
(:func:`load_local_shards`), so no rank ever holds the whole model.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from skylift.config.distributed import FsdpConfig
from skylift.errors import SkyliftConfigError
from skylift.loop.collectives import collective
from skylift.train.placement import Placement
from skylift.train.precision import PrecisionPolicy
from skylift.train.shard_loading import load_local_shards, local_part, rebuild_non_persistent_buffers
from skylift.train.sharding_options import check_sharding_options

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "DEFAULT_BLOCK_TYPES",
    "Sharding",
    "check_sharding_options",
    "clip_gradients",
    "global_grad_norm",
    "local_gradients",
    "lockstep",
    "meta_copy",
    "mixed_precision",
    "select_blocks",
    "sharding_for",
    "tied_duplicates",
]

log = logging.getLogger("skylift")

DEFAULT_BLOCK_TYPES = ("BasicBlock", "Bottleneck", "TransformerEncoderLayer", "TransformerDecoderLayer")
"""Blocks sharded one by one when neither ``distributed.fsdp.block_types`` nor the model
(a Hugging Face model's ``_no_split_modules``) names any: torchvision's residual blocks
and ``torch.nn``'s transformer layers."""

_CLIP_EPSILON = 1e-6  # torch.nn.utils.clip_grads_with_norm_'s, so a clipped step equals torch's


def select_blocks(model: nn.Module, block_types: list[str]) -> list[nn.Module]:
    """The submodules to shard before the root, innermost first (a block inside another
    block is sharded before it, as ``fully_shard`` requires).

    Args:
        model: the whole model (never a block of itself).
        block_types: class names; empty: the model's ``_no_split_modules`` where they name
            a module of it, else :data:`DEFAULT_BLOCK_TYPES`; none present: no blocks, and
            the root is the one unit.

    Raises:
        SkyliftConfigError: a name in ``block_types`` matches no module of the model (the
            message lists the model's module classes).
    """
    present = {type(module).__name__ for module in model.modules()}
    if block_types:
        missing = sorted(set(block_types) - present)
        if missing:
            raise SkyliftConfigError(
                f"distributed.fsdp.block_types: {', '.join(missing)} name no module of {type(model).__name__}; "
                f"its module classes are: {', '.join(sorted(present))}",
                hint="Name block classes from that list (a transformer's layer, a ResNet's block), or leave "
                "block_types empty for the model's own list.",
            )
        wanted = set(block_types)
    else:
        own = set(getattr(model, "_no_split_modules", None) or ())
        wanted = (own & present) or (set(DEFAULT_BLOCK_TYPES) & present)
    return [module for module in reversed(list(model.modules()))
            if module is not model and type(module).__name__ in wanted]  # fmt: skip


def mixed_precision(precision: PrecisionPolicy, reduce_dtype: str) -> Any:
    """The ``MixedPrecisionPolicy`` for ``precision``: bf16 or fp16 parameters in forward and
    backward (the sharded master copy stays fp32), gradients reduced in ``reduce_dtype``.
    fp32 and tf32 with fp32 reduction: no policy, so the arithmetic is the unsharded model's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision.name)
    reduce = torch.bfloat16 if reduce_dtype == "bf16" else torch.float32
    if param_dtype is None and reduce is torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)


def sharding_for(strategy: str, settings: FsdpConfig | None, placement: Placement) -> Sharding | None:
    """The :class:`Sharding` ``strategy: fsdp`` asks for (checked), else ``None``."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    if strategy != "fsdp":
        return None
    settings = settings or FsdpConfig()
    check_sharding_options(precision=placement.precision.name, channels_last=placement.channels_last,
                           cpu_offload=settings.cpu_offload)  # fmt: skip
    return Sharding(settings, placement.precision, placement.device,
                    compile_mode=placement.compile_mode if placement.compile else None)  # fmt: skip


class Sharding:
    """FSDP2 for one process's model, as ``distributed.fsdp`` says.

    Args:
        settings: the ``distributed.fsdp`` section.
        precision: the resolved precision (the mixed-precision policy follows it).
        device: this rank's device (the mesh's device type).
        compile_mode: ``torch.compile`` the forward of each block that holds no other
            block (or of the root, without blocks) in this mode before it is sharded;
            ``None``: no compilation.
    """

    def __init__(self, settings: FsdpConfig, precision: PrecisionPolicy, device: torch.device,
                 compile_mode: str | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.precision = precision
        self.device = device
        self.compile_mode = compile_mode
        self.keep_meta_copy = False
        """Keep an unsharded copy of the model on the ``meta`` device (set before :meth:`apply`)."""
        self.meta_copy: nn.Module | None = None
        """The model as it was before sharding, on ``meta``: what FLOP counting traces,
        since a forward through the sharded model is a collective."""
        self.weights_source: Path | None = None
        self.weights_name: Callable[[str], str | None] = lambda name: name
        """A tensor's name in :attr:`weights_source`'s files; None: not there (the recipe's ``weights_name``)."""
        self.initialise_unloaded: Callable[[nn.Module], None] | None = None
        """Fills what :attr:`weights_name` leaves out, once the rest is loaded (the recipe's)."""
        """A folder of safetensors files (by parameter name) to load a model built on the
        ``meta`` device from, each rank only its shards (set before :meth:`apply`)."""
        self.root: FSDPModule | None = None
        self.blocks: list[nn.Module] = []
        self.created_process_group = False
        self._replaced: dict[int, nn.Parameter] = {}
        self._gradient_sync: bool | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        """Shard ``model`` (placed on its device) in place and return it; blocks first, then the root."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        blocks = select_blocks(model, self.settings.block_types)  # a bad name fails before any group exists
        kinds = ", ".join(sorted({type(block).__name__ for block in blocks}))  # before FSDP renames them
        self._ensure_process_group()
        if self.keep_meta_copy:
            self.meta_copy = meta_copy(model)
        before = dict(model.named_parameters(remove_duplicate=False))
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        options = {"mesh": mesh, "reshard_after_forward": self.settings.reshard_after_forward,
                   "mp_policy": mixed_precision(self.precision, self.settings.reduce_dtype),
                   "offload_policy": self._offload_policy()}  # fmt: skip
        self.blocks = blocks
        holders = {id(outer) for outer in blocks for inner in blocks if inner is not outer
                   and any(module is inner for module in outer.modules())}  # fmt: skip
        for block in blocks:
            if id(block) not in holders:  # a block's own sharded blocks would break its graph
                self._compile(block)
            fully_shard(block, **options)
        if not blocks:
            self._compile(model)
        root = fully_shard(model, **options)
        if any(parameter.is_meta for parameter in model.parameters()):
            self._materialize(model)
        after = dict(model.named_parameters(remove_duplicate=False))
        self._replaced = {id(parameter): after[name] for name, parameter in before.items()}
        self.root = root
        if blocks:
            log.info("fsdp: %d block(s) of %s sharded over %d rank(s), then the root", len(blocks), kinds,
                     dist.get_world_size())  # fmt: skip
        else:
            log.info("fsdp: no block classes in the model (distributed.fsdp.block_types names them): the whole "
                     "model is one unit, sharded over %d rank(s)", dist.get_world_size())
        return model

    def shard_alike(self, module: nn.Module, like: nn.Module) -> nn.Module:
        """Shard a frozen ``module`` of ``like``'s architecture (DPO's reference copy) as
        :meth:`apply` sharded ``like``: the same units, the same mesh and dtypes, no compile;
        built on ``meta``, each rank loads its shards from :attr:`weights_source` as the
        policy did, so it holds the starting weights too."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self.root is None:
            raise RuntimeError("apply() shards the model first")
        mesh = next(parameter for parameter in like.parameters()).device_mesh  # type: ignore[attr-defined]
        options = {"mesh": mesh, "reshard_after_forward": self.settings.reshard_after_forward,
                   "mp_policy": mixed_precision(self.precision, self.settings.reduce_dtype),
                   "offload_policy": self._offload_policy()}  # fmt: skip
        units = [name for name, unit in like.named_modules() if isinstance(unit, FSDPModule) and name]
        for name in units:
            fully_shard(module.get_submodule(name), **options)
        fully_shard(module, **options)
        if any(parameter.is_meta for parameter in module.parameters()):
            self._materialize(module)
        held = sum(cast(Any, parameter).to_local().numel() * parameter.element_size()  # DTensors now
                   for parameter in module.parameters())
        log.info("fsdp: DPO's frozen reference copy sharded as the model: %.1f MiB on this rank", held / 2**20)
        return module.requires_grad_(False).eval()

    def _materialize(self, model: nn.Module) -> None:
        """Memory for this rank's shards only, filled from :attr:`weights_source`."""
        if self.weights_source is None:
            raise SkyliftConfigError("the model was built on the meta device, with no weights folder to load it from",
                                     hint="Build it on a real device, or give the recipe a weights_source().")
        model.to_empty(device=self.device)
        rebuild_non_persistent_buffers(model)
        loaded = load_local_shards(model, self.weights_source, self.weights_name)
        if self.initialise_unloaded is not None:
            self.initialise_unloaded(model)  # what the folder does not hold (LoRA's adapters)
        log.info("fsdp: built on the meta device; this rank loaded its shards of %d tensors from %s", loaded,
                 self.weights_source)  # fmt: skip

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point an optimizer built on the unsharded parameters at their sharded replacements
        (``fully_shard`` swaps every parameter for a new ``DTensor`` one).

        Raises:
            SkyliftConfigError: the optimizer already has state, which cannot be resliced here.
        """
        if optimizer.state:
            raise SkyliftConfigError(
                "distributed.strategy: fsdp: the optimizer handed to runtime.prepare already has state; pass a "
                "fresh optimizer (its state is restored from the checkpoint by runtime.resume)")
        for group in optimizer.param_groups:
            group["params"] = [self._replaced.get(id(parameter), parameter) for parameter in group["params"]]

    def set_gradient_sync(self, sync: bool) -> None:
        """Reduce-scatter gradients in this micro-step's backward (the last of an accumulation
        group) or keep accumulating them unsharded and local (the others)."""
        if self.root is not None and sync != self._gradient_sync:
            self.root.set_requires_gradient_sync(sync)
            self._gradient_sync = sync

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's tensors on rank 0's host (empty on other ranks); a collective: every
        rank calls it. Tied parameters appear once, under the name ``safetensors.save_model``
        keeps, so the file matches an unsharded run's."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # A model's state holds only tensors; the annotation is the optimizer's value type too.
        state = cast(dict[str, torch.Tensor],
                     get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
        for duplicate in tied_duplicates(model):
            state.pop(duplicate, None)
        return state

    def weights_writer(self, model: nn.Module, path: str) -> Callable[[], None]:
        """Gather the full weights now (every rank calls this) and return what writes them as
        safetensors at ``path`` (called on rank 0 only)."""
        from safetensors.torch import save_file

        state = self.full_state_dict(model)
        return lambda: save_file({name: tensor.contiguous() for name, tensor in state.items()}, path)

    def release(self) -> None:
        """End the one-rank process group :meth:`apply` made (a one-process run), if it made one."""
        if self.created_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self.created_process_group = False

    def _ensure_process_group(self) -> None:
        # FSDP shards over a process group even on one rank; a one-process run has none.
        # An in-memory store: a group of one needs no address or port.
        if dist.is_initialized():
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                device_id=self.device if self.device.type == "cuda" else None)  # fmt: skip
        self.created_process_group = True

    def _compile(self, module: nn.Module) -> None:
        # The forward only, in place: FSDP's hooks run around it, outside the compiled graph
        # (inside it each hook is a graph break), and the state dict's names stay the same.
        if self.compile_mode is not None:
            module.forward = torch.compile(module.forward, mode=self.compile_mode)

    def _offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if not self.settings.cpu_offload:
            return OffloadPolicy()
        # Pinned host memory needs a CUDA driver; on a CPU device the copies are host to host.
        return CPUOffloadPolicy(pin_memory=self.device.type == "cuda")


def tied_duplicates(model: nn.Module) -> list[str]:
    """Names of parameters that are another name's parameter (tied weights), all but the one
    ``safetensors`` keeps (the first in sorted order)."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return [name for group in names.values() for name in sorted(group)[1:]]


def meta_copy(model: nn.Module) -> nn.Module:
    """``model``'s structure with every parameter and buffer on the ``meta`` device: the
    modules are copied, the tensors' data is not."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device="meta"),
                                           requires_grad=parameter.requires_grad)  # fmt: skip
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def local_gradients(parameters: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [local_part(parameter.grad) for parameter in parameters if parameter.grad is not None]


def global_grad_norm(gradients: list[torch.Tensor], device: torch.device, *, sharded: bool,
                     reduce_device: torch.device) -> torch.Tensor:  # fmt: skip
    """The L2 norm of every gradient of the model, as a plain fp32 tensor on ``device``.

    ``gradients`` are this rank's: whole tensors under DDP (every rank holds all of them),
    slices under FSDP (``sharded``: the squares are summed over the ranks). The squares are
    summed in fp64 and the root rounded once to fp32, so the result does not depend on how
    the gradients are split: DDP, FSDP and any world size give the same fp32 norm, bit for
    bit, unless the fp64 sums (which differ by about 1e-16 relative) straddle an fp32
    rounding boundary.
    """
    if gradients:
        norms = torch._foreach_norm(gradients, 2, dtype=torch.float64)
        squares = torch.stack([norm.to(device) for norm in norms]).square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float64, device=device)
    if sharded and dist.get_world_size() > 1:
        on_reduce_device = squares.to(reduce_device)
        with collective("the gradient norm (all_reduce)"):
            dist.all_reduce(on_reduce_device, op=dist.ReduceOp.SUM)
        squares = on_reduce_device.to(device)
    return squares.sqrt().float()


def clip_gradients(gradients: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``gradients`` in place by ``min(1, max_norm / (total_norm + 1e-6))``, the arithmetic
    of ``torch.nn.utils.clip_grads_with_norm_``, on plain (local) tensors."""
    coefficient = torch.clamp(max_norm / (total_norm + _CLIP_EPSILON), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for gradient in gradients:
        by_device.setdefault(gradient.device, []).append(gradient)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coefficient.to(device))


_END = object()


def lockstep(batches: Iterable[Any], device: torch.device, rank: int) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` until every rank's ``batches`` are done: a rank whose batches ran
    out repeats its last one, uncounted, so each rank runs as many forwards (each one
    gathers parameters from all ranks) as the one with the most. One 2-element
    all-reduce per batch.

    Raises:
        SkyliftConfigError: on every rank, when some rank has no batch at all (it has none
            to repeat): fewer evaluation samples than ranks.
    """
    iterator = iter(batches)
    last: Any = _END
    while True:
        batch = next(iterator, _END)
        flags = torch.tensor([batch is not _END, batch is _END and last is _END], dtype=torch.int32, device=device)
        with collective("the end-of-data agreement (all_reduce)"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_left, some_rank_empty = bool(flags[0]), bool(flags[1])
        if not any_left:
            return
        if some_rank_empty:
            raise SkyliftConfigError(
                f"evaluation under distributed.strategy: fsdp: a rank (this is rank {rank}) has no evaluation "
                "batch while others have some, so the ranks' sharded forwards cannot pair up",
                hint="Give the validation set at least one sample per rank (data.val_fraction), or evaluate "
                "with strategy: ddp.")
        if batch is _END:
            yield last, False
        else:
            last = batch
            yield batch, True

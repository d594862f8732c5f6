"""How much device memory one training rank needs, estimated without a GPU.

The model is built on the ``meta`` device (shapes only: no memory, no arithmetic,
seconds even for a ResNet-50), one micro-batch's loss is traced through it, and the
tensors autograd saves for backward are added up through
:func:`torch.autograd.graph.saved_tensors_hooks`. Those saved tensors are what a
step holds at its peak, next to the weights, gradients, DDP buckets and optimizer
state that :func:`skylift.machine.memory.training_memory` adds (the one memory model,
which ``skylift plan`` fits candidates with too). Under ``distributed.strategy: fsdp``
the same trace also counts the blocks FSDP shards one by one, whose largest sizes what
a rank gathers, and the state is divided by the ranks.

It is an estimate: allocator fragmentation, cuBLAS/cuDNN workspaces and the CUDA
context (a few hundred MiB) come on top, which is why the rule warns from 90 %.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from skylift.machine.facts import MemoryEstimate

if TYPE_CHECKING:
    import torch
    from torch import nn

    from skylift.config.schema import RunConfig
    from skylift.machine.memory import ModelMemory

__all__ = ["estimate_memory", "meta_model_and_batch", "nf4_quantized_parameters", "sample_shape", "trace_model_memory"]


def sample_shape(config: RunConfig) -> tuple[int, tuple[int, ...]] | None:
    """``(in_channels, image shape)`` of the configured image data; None for text or
    streamed data (whose shape is known only once the first shard is read)."""
    if config.data.url or config.recipe.name != "image_classification":
        return None
    from skylift.recipes import check_recipe_settings

    settings = check_recipe_settings(config)
    if settings.dataset == "digits":
        return 1, (1, 8, 8)  # scikit-learn's 8x8 grey digits
    return 3, (3, settings.image_size, settings.image_size)


def estimate_memory(config: RunConfig, micro_batch_size: int, world_size: int) -> MemoryEstimate:
    """Peak memory of one rank training ``config`` with ``micro_batch_size`` samples, by
    :func:`skylift.machine.memory.training_memory` (the model ``skylift plan`` fits with);
    under ``distributed.strategy: fsdp`` sharded over the ``world_size`` ranks.

    Example:
        >>> estimate_memory(load_config("examples/quickstart.yaml"), 64, 1).total_bytes > 0
        True
    """
    import torch

    from skylift.machine.memory import Sharding, training_memory

    sharding = Sharding.of(config.distributed, world_size)
    try:
        model = trace_model_memory(config, micro_batch_size, sharded=sharding is not None)
    except Exception as error:  # noqa: BLE001 - an unknown model leaves the estimate out, not the report
        return MemoryEstimate(note=f"model not traced: {type(error).__name__}: {error}")
    half = config.precision in ("fp16", "bf16") or (config.precision == "auto" and torch.cuda.is_available())
    # A token budget packs the rows per micro-step; accumulation then comes only from its own setting.
    rows_per_step = micro_batch_size * world_size if config.data.batching != "token_budget" else 0
    accumulating = config.accumulation.steps > 1 or 0 < rows_per_step < config.data.global_batch_size
    breakdown = training_memory(model, micro_batch_size, half_precision=half, world_size=world_size,
                                sharding=sharding, accumulating=accumulating)  # fmt: skip
    return MemoryEstimate(
        parameters=model.parameters,
        trainable_parameters=model.trainable_parameters,
        adapters=model.adapters,
        frozen_weight_bytes=breakdown.frozen_weight_bytes,
        quantized_parameters=model.quantized_parameters,
        reference_bytes=breakdown.reference_bytes,
        parameter_bytes=breakdown.parameter_bytes,
        gradient_bytes=breakdown.gradient_bytes + breakdown.bucket_bytes,
        bucket_bytes=breakdown.bucket_bytes,
        optimizer_bytes=breakdown.optimizer_state_bytes,
        ema_bytes=breakdown.ema_bytes,
        autocast_weight_bytes=breakdown.autocast_weight_bytes,
        activation_bytes=breakdown.activation_bytes,
        total_bytes=breakdown.total_bytes,
        # The whole checkpoint: under FSDP every rank writes its shard of it; with adapters the
        # frozen base stays out of it (skylift.recipes.adapters.keep_trainable_only).
        checkpoint_bytes=(breakdown.parameter_bytes - breakdown.frozen_weight_bytes
                          + breakdown.optimizer_state_bytes) * breakdown.shard_count,
        shard_count=breakdown.shard_count,
        unsharded_bytes=breakdown.unsharded_bytes,
        host_bytes=breakdown.host_bytes,
        sharding=sharding.describe() if sharding else None,
        note=model.note,
    )


def trace_model_memory(config: RunConfig, micro_batch_size: int, *, sharded: bool = False) -> ModelMemory:
    """What training ``config``'s model holds, from a trace of one micro-batch of
    ``micro_batch_size`` samples on meta; activations ``None`` (with a note) when an op
    has no meta kernel. ``sharded``: also count the FSDP blocks
    (``distributed.fsdp.block_types``) that size what a sharded step gathers.

    Raises:
        Exception: whatever building the model on meta raises (an unknown model, streamed
            images whose shape is unknown).
    """
    from skylift.machine.memory import ModelMemory
    from skylift.train.sharding import select_blocks

    model, batch, loss = meta_model_and_batch(config, micro_batch_size)
    blocks = select_blocks(model, config.distributed.fsdp.block_types) if sharded else None
    adapters = _adapters(config, model) | _reference(config, model)
    adapters["checkpoint_in_memory"] = config.checkpoint.enabled and config.checkpoint.memory.enabled
    if config.recipe.name == "causal_lm":
        # On meta, attention takes the math path, which saves the sequence-squared score
        # matrix that a GPU's fused kernels never hold, and activation checkpointing does
        # not trace: counted, the activations would refuse jobs that fit. The state is exact.
        return ModelMemory.of(model, config.optim, blocks=blocks, **adapters, note="activations not traced: a "
                              "causal language model's attention and activation checkpointing do not trace on meta")
    saved, note = _saved_tensors(model, batch, loss)
    return ModelMemory.of(
        model, config.optim, blocks=blocks, note=note, **adapters,
        saved_float_elements_per_sample=None if saved is None else saved[0] / micro_batch_size,
        saved_other_bytes_per_sample=0.0 if saved is None else saved[1] / micro_batch_size,
    )


def meta_model_and_batch(config: RunConfig, micro_batch_size: int) -> tuple[nn.Module, Any, Any]:
    import torch

    from skylift.recipes import build_recipe

    recipe = build_recipe(config)
    settings = recipe.settings
    declared = getattr(settings, "num_classes", None)
    num_classes = declared or (10 if config.recipe.name == "image_classification" else 2)
    with torch.device("meta"):
        if config.recipe.name == "text_classification":
            model = _meta_text_model(settings, num_classes)
            batch = _text_batch(config, settings.max_length, micro_batch_size)
        elif config.recipe.name == "causal_lm":
            # The folder's config.json: the architecture only (causal_lm needs no dataset for it).
            lora = getattr(settings, "lora", None)
            if lora is not None and lora.quantize_base is not None:
                # A 4-bit base needs bitsandbytes on a GPU to be built; on meta the adapters go on the
                # full-precision architecture and trace_model_memory counts the 4-bit bytes instead.
                settings.lora = lora.model_copy(update={"quantize_base": None})
            model = cast(Any, recipe).build_model(None)
            ids = torch.zeros(micro_batch_size, settings.sequence_length, dtype=torch.long)
            batch = (ids, None, ids)  # input ids, no padding mask, labels
        else:
            from skylift.data.datasets import DatasetSplit

            shape = sample_shape(config)
            if shape is None:
                raise ValueError("streamed images: the sample shape is known only after the first shard")
            split = DatasetSplit(train=None, val=None, num_classes=num_classes, in_channels=shape[0])  # type: ignore[arg-type]
            model = recipe.build_model(split)
            batch = (torch.empty(micro_batch_size, *shape[1]), torch.zeros(micro_batch_size, dtype=torch.long))
    model.train()
    return model, batch, recipe.training_loss


def _adapters(config: RunConfig, model: nn.Module) -> dict[str, Any]:
    """:meth:`ModelMemory.of`'s adapter arguments for ``recipe.lora``: what trains, in words,
    and under ``quantize_base`` the frozen weights bitsandbytes holds in 4-bit NF4."""
    if config.recipe.name != "causal_lm":
        return {}
    from skylift.recipes import check_recipe_settings

    lora = check_recipe_settings(config).lora
    if lora is None:
        return {}
    recomputed = _checkpointed_blocks(config, model)
    if lora.quantize_base is None:
        return {"adapters": f"LoRA rank {lora.rank}", "recomputed": recomputed}
    return {"adapters": f"QLoRA rank {lora.rank}, base in 4-bit NF4", "quantized": nf4_quantized_parameters(model),
            "recomputed": recomputed}


def _reference(config: RunConfig, model: nn.Module) -> dict[str, Any]:
    """DPO's frozen copy of the starting model (``recipe.dpo.reference: frozen_copy``): its
    weights as built, kept beside the policy (:class:`skylift.recipes.preference.Reference`);
    none when the reference log-probabilities are precomputed (the table is a few bytes a pair)."""
    if config.recipe.name != "causal_lm":
        return {}
    from skylift.recipes import check_recipe_settings

    settings = check_recipe_settings(config)
    dpo = settings.dpo
    if settings.objective != "dpo" or dpo is None or dpo.reference != "frozen_copy" or dpo.precompute_reference:
        return {}
    return {"reference_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def _checkpointed_blocks(config: RunConfig, model: nn.Module) -> list[nn.Module]:
    """The blocks ``activation_checkpointing`` recomputes: a Hugging Face model's own switch
    takes its ``GradientCheckpointingLayer`` s (the decoder layers,
    :func:`skylift.train.model_tools.apply_activation_checkpointing`), else the named types."""
    if not config.activation_checkpointing.enabled:
        return []
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: the named types only
        GradientCheckpointingLayer = ()  # type: ignore[assignment,misc]
    names = set(config.activation_checkpointing.module_types)
    switch = hasattr(model, "gradient_checkpointing_enable") or hasattr(model, "activation_checkpointing_enable")
    return [module for module in model.modules()
            if (switch and isinstance(module, GradientCheckpointingLayer)) or type(module).__name__ in names]


def nf4_quantized_parameters(model: nn.Module) -> list[Any]:
    """The weights a 4-bit base holds in NF4: transformers' bitsandbytes integration replaces
    every ``nn.Linear`` but the output head (``modules_to_not_convert`` defaults to the
    output embeddings) by ``bnb.nn.Linear4bit``, whose weight is quantised and whose bias
    stays in the compute dtype; the adapters (trainable) and the embeddings, norms and head
    keep their dtype. ``model`` may already carry PEFT's adapters (the frozen base layer of
    each adapted linear is the one quantised)."""
    from torch import nn

    base: Any = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    head_weights = {id(parameter) for parameter in head.parameters()} if head is not None else set()
    return [module.weight for module in model.modules()
            if isinstance(module, nn.Linear) and not module.weight.requires_grad
            and id(module.weight) not in head_weights]  # fmt: skip


def _meta_text_model(settings: Any, num_classes: int) -> nn.Module:
    # The recipe's build_model loads the pretrained weights; on meta only the
    # architecture is needed, which the folder's config.json describes.
    from skylift.recipes.hf_models import load_classifier, model_folder

    return load_classifier(model_folder(settings.model, settings.model_path), num_classes, meta=True,
                           added_tokens=settings.add_unknown_characters)  # at most that many


def _text_batch(config: RunConfig, length: int, micro_batch_size: int) -> tuple[Any, ...]:
    import torch

    data = config.data
    rows = max(1, data.max_tokens // length) if data.batching == "token_budget" else micro_batch_size
    return (
        torch.zeros(rows, length, dtype=torch.long),
        # No mask: rows of full length need none, and transformers' mask shortcut reads
        # the mask's values, which meta tensors do not have.
        None,
        torch.zeros(rows, dtype=torch.long),
    )


def _saved_tensors(model: nn.Module, batch: Any, loss_fn: Any) -> tuple[tuple[int, int] | None, str | None]:
    """(floating-point elements, bytes of the other tensors) autograd saves for backward in
    one forward, each storage counted once and the parameters (counted apart) left out.

    That is what the forward leaves alive for backward: the activation peak, short of an
    op's own temporaries (its output before the next op saves it, workspaces)."""
    import torch

    parameter_ids = {id(parameter) for parameter in model.parameters()}
    seen: dict[int, torch.Tensor] = {}  # keeps each tensor alive so its id stays unique

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in parameter_ids:
            seen.setdefault(id(base), base)
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss_fn(model, batch)
    except Exception as error:  # noqa: BLE001 - an op without a meta kernel: parameters still count
        return None, f"activations not traced: {type(error).__name__}: {error}"
    floats = sum(tensor.numel() for tensor in seen.values() if tensor.is_floating_point())
    others = sum(tensor.numel() * tensor.element_size() for tensor in seen.values() if not tensor.is_floating_point())
    return (floats, others), None

"""LoRA adapters on a causal language model, through PEFT (``recipe.lora``).

:func:`apply_lora` freezes the model and adds PEFT's adapters to the linear layers that
``recipe.lora.target_modules`` names (default: every linear layer but the output head).
:func:`keep_trainable_only` then makes the model's ``state_dict`` hold the trainable
parameters (the adapters) and buffers only: a checkpoint, the final
``RUN_DIR/model.safetensors`` and the moving average's copy store what training changes,
never the frozen base, which the recipe builds again from ``recipe.model_path`` (or the
tiny Llama's seed) on every resume and export. Loading such a state dict leaves the
frozen weights as built and still refuses a missing or unexpected adapter.

Under FSDP2 the same hooks decide the sharded checkpoint: DCP's ``get_state_dict`` and
``set_model_state_dict`` go through the model's ``state_dict`` and ``load_state_dict``, so
the sharded layout holds the adapters' chunks and their optimizer state only. FSDP2
shards per parameter, so a unit (a decoder layer) holding frozen base weights and
trainable adapters together needs nothing here: it all-gathers both for the forward and
reduce-scatters only the gradients that exist.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from skylift.errors import SkyliftConfigError
from skylift.recipes.settings.causal_lm import LoraSettings

__all__ = ["apply_lora", "base_weight_name", "check_quantization", "initialise_adapters", "keep_trainable_only",
           "linear_layer_names", "load_quantized", "quantization_config", "target_modules"]

log = logging.getLogger("skylift")

_INSTALL_HINT = "install skylift's llm extra: pip install -c requirements/constraints.txt -e '.[llm]'"


def linear_layer_names(model: nn.Module) -> list[str]:
    """The distinct last names of ``model``'s ``nn.Linear`` layers (``q_proj``, ``lm_head``, ...)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)})


def target_modules(model: nn.Module, lora: LoraSettings) -> list[str]:
    """The layer names that get adapters: ``lora.target_modules``, each checked to match a
    linear layer, or every linear layer's name but the output head's.

    Raises:
        SkyliftConfigError: a name matches no linear layer (lists the model's).
    """
    linear = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    if lora.target_modules is None:
        # A Hugging Face model's method, which nn.Module's type does not know.
        head = cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        heads = {name for name, module in model.named_modules() if module is head}
        names = sorted({name.rsplit(".", 1)[-1] for name in linear - heads})
        if not names:
            raise SkyliftConfigError(f"recipe.lora: {type(model).__name__} has no linear layer besides its output "
                                     "head to put adapters on", hint="Set recipe.lora: null (full fine-tuning)")
        return names
    unmatched = [wanted for wanted in lora.target_modules
                 if not any(name == wanted or name.endswith("." + wanted) for name in linear)]  # fmt: skip
    if unmatched:
        raise SkyliftConfigError(
            f"recipe.lora.target_modules: {', '.join(unmatched)} matches no linear layer of {type(model).__name__}; "
            f"its linear layers are named {', '.join(linear_layer_names(model))}",
            hint="Name some of those, or set target_modules: null for every one but the output head")
    return list(lora.target_modules)


def _modules_to_save(model: nn.Module, lora: LoraSettings) -> list[str] | None:
    if lora.modules_to_save is None:
        return None
    names = [name for name, _ in model.named_modules()]
    unmatched = [wanted for wanted in lora.modules_to_save
                 if not any(name == wanted or name.endswith("." + wanted) for name in names)]  # fmt: skip
    if unmatched:
        children = sorted({name.rsplit(".", 1)[-1] for name in names if name})
        raise SkyliftConfigError(
            f"recipe.lora.modules_to_save: {', '.join(unmatched)} matches no layer of {type(model).__name__}; its "
            f"layers are named {', '.join(children[:40])}", hint="Name some of those (e.g. lm_head), or null")
    return list(lora.modules_to_save)


def apply_lora(model: nn.Module, lora: LoraSettings, seed: int) -> nn.Module:
    """``model`` frozen, with PEFT LoRA adapters on :func:`target_modules`, its state dict
    the adapters' only (:func:`keep_trainable_only`), the adapters drawn by
    :func:`initialise_adapters` from ``seed`` (B at zero: the model's output is unchanged)."""
    peft = _peft()
    targets = target_modules(model, lora)
    whole = _modules_to_save(model, lora)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                             modules_to_save=whole, task_type="CAUSAL_LM")  # fmt: skip
    with warnings.catch_warnings():
        # PEFT 0.21 asks transformers 5 the deprecated is_gradient_checkpointing: a warning per build,
        # nothing to fix here.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if getattr(model, "is_loaded_in_4bit", False):
            # QLoRA: the layers kept whole (norms, embeddings, head) in fp32 and the inputs'
            # gradients on, as PEFT prepares a k-bit model; skylift's own setting decides
            # activation checkpointing.
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        adapted = peft.get_peft_model(model, config)
    trainable = sum(parameter.numel() for parameter in adapted.parameters() if parameter.requires_grad)
    # A 4-bit weight is stored two values a byte: its tensor counts half its parameters.
    total = sum(parameter.numel() * (2 if type(parameter).__name__ == "Params4bit" else 1)
                for parameter in adapted.parameters())  # fmt: skip
    if adapted.base_model.model.device.type != "meta":  # on meta, initialise_adapters runs once loaded
        initialise_adapters(adapted, seed)
        base = " over the base in 4-bit NF4" if lora.quantize_base else ""
        log.info("causal_lm: LoRA rank %d on %s%s: %d trainable parameters of %d (%.2f%%)", lora.rank,
                 ", ".join(targets), base, trainable, total, 100.0 * trainable / max(total, 1))  # fmt: skip
    return keep_trainable_only(adapted)


def initialise_adapters(model: nn.Module, seed: int) -> None:
    """Draw every adapter's A matrix with PEFT's initialisation (Kaiming uniform with
    ``a = sqrt(5)``: uniform within ``1 / sqrt(fan_in)``) from a generator of ``seed``, in
    module order, and set B to zero. PEFT draws from the global random state, whose
    position depends on how much the base's construction consumed; drawn here, a model
    built whole and one built on the meta device and loaded by shard (FSDP) start from
    the same adapters. A sharded parameter (a DTensor, FSDP2's rows on dim 0) takes this
    rank's rows of the same draw."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            lora_a, lora_b = getattr(module, "lora_A", None), getattr(module, "lora_B", None)
            if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
                continue
            for adapter, layer in lora_a.items():
                a_matrix, b_matrix = cast(torch.Tensor, layer.weight), cast(torch.Tensor, lora_b[adapter].weight)
                bound = 1.0 / math.sqrt(a_matrix.shape[1])  # the global shape, a DTensor's too
                _fill_rows(a_matrix, torch.empty(a_matrix.shape).uniform_(-bound, bound, generator=generator))
                _fill_rows(b_matrix, torch.zeros(b_matrix.shape))


def _fill_rows(parameter: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``parameter``, or into this rank's rows of it when it is sharded."""
    to_local = getattr(parameter, "to_local", None)
    if not callable(to_local):
        parameter.copy_(full)
        return
    local = to_local()
    mesh = cast(Any, parameter).device_mesh
    chunk = -(-full.shape[0] // mesh.size())
    start = min(mesh.get_local_rank() * chunk, full.shape[0])
    local.copy_(full[start : start + local.shape[0]])


def base_weight_name(name: str) -> str | None:
    """The name in the base model's own files of a PEFT model's tensor ``name``: PEFT's
    prefix and wrappers (``base_layer``, ``original_module``, a ``modules_to_save`` copy,
    which starts as the original) taken out; None for an adapter's own matrices."""
    parts = name.split(".")
    if "lora_A" in parts or "lora_B" in parts or "lora_embedding_A" in parts or "lora_embedding_B" in parts:
        return None
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    kept: list[str] = []
    index = 0
    while index < len(parts):
        if parts[index] in ("base_layer", "original_module"):
            index += 1
        elif parts[index] == "modules_to_save":
            index += 2  # "modules_to_save.<adapter>"
        else:
            kept.append(parts[index])
            index += 1
    return ".".join(kept)


def keep_trainable_only(model: nn.Module) -> nn.Module:
    """Make ``model.state_dict()`` leave out its frozen parameters (``requires_grad``
    False when asked), and ``load_state_dict`` accept a state dict without them: they
    keep the values they were built with. Returns ``model``."""

    def frozen_names(module: nn.Module) -> set[str]:
        return {name for name, parameter in module.named_parameters(remove_duplicate=False)
                if not parameter.requires_grad}  # fmt: skip

    def drop_frozen(module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
        frozen = frozen_names(module)
        for name in frozen:
            state_dict.pop(prefix + name, None)
        # A 4-bit weight (bitsandbytes' Params4bit) saves its quantization state beside it,
        # as "<name>.absmax", "<name>.quant_map", ...: frozen too.
        for key in [key for key in state_dict if key.startswith(prefix)]:
            if key[len(prefix):].rpartition(".")[0] in frozen or ".quant_state." in key:
                state_dict.pop(key)

    def forgive_frozen(module: nn.Module, incompatible_keys: Any) -> None:
        frozen = frozen_names(module)
        # Under a wrapper (a moving average's copy) the keys carry its prefix.
        kept = [key for key in incompatible_keys.missing_keys
                if not any(key.split(".", cut)[-1] in frozen for cut in range(key.count(".") + 1))]  # fmt: skip
        incompatible_keys.missing_keys[:] = kept

    model.register_state_dict_post_hook(drop_frozen)
    model.register_load_state_dict_post_hook(forgive_frozen)
    return model


def check_quantization(lora: LoraSettings | None, device: torch.device | str) -> None:
    """Refuse ``lora.quantize_base`` on a device bitsandbytes' NF4 does not run on, or
    without bitsandbytes installed (the llm extra), naming the fix."""
    if lora is None or lora.quantize_base is None:
        return
    lora.check_device(torch.device(device).type)
    try:
        import bitsandbytes  # noqa: F401  (transformers' 4-bit layers are bitsandbytes')
    except ImportError:
        raise SkyliftConfigError("recipe.lora.quantize_base: nf4 needs the bitsandbytes package",
                                 hint=_INSTALL_HINT) from None


def quantization_config(lora: LoraSettings, compute_dtype: torch.dtype) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``lora.quantize_base``: NF4, one fp32 scale
    per block of 64 weights (0.5625 bytes a weight, what doctor and plan count:
    :func:`~skylift.machine.memory.nf4_bytes_per_parameter`; transformers' default of no
    double quantization, which would save 0.047 more), computing in ``compute_dtype``."""
    import transformers

    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=lora.quantize_base,
                                           bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype=compute_dtype)


def load_quantized(folder: Path | None, build: Callable[[], nn.Module], lora: LoraSettings, device_type: str,
                   precision: str) -> nn.Module:
    """QLoRA's base: the model in ``folder`` (None: the one ``build`` makes, written to a
    folder first, so both load one way) with its linear layers in 4-bit NF4, loaded by
    transformers through bitsandbytes onto the run's device, computing in the run's
    precision (``auto``: bf16 on CUDA, fp32 on the CPU)."""
    import tempfile

    import transformers

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        precision, torch.bfloat16 if device_type == "cuda" else torch.float32)
    options = {"quantization_config": quantization_config(lora, compute), "dtype": torch.float32,
               "device_map": {"": device}, "local_files_only": True}  # fmt: skip
    load = transformers.AutoModelForCausalLM.from_pretrained
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a bar per load on every rank's stderr, in the run's log
    try:
        if folder is not None:
            return cast(nn.Module, load(str(folder), **options))
        with tempfile.TemporaryDirectory(prefix="skylift-base-") as written:
            # Written without save_pretrained, which writes nothing on a rank other than 0
            # once torch.distributed is up (every rank loads its own copy here).
            from safetensors.torch import save_model

            built = cast(Any, build())
            built.config.to_json_file(str(Path(written) / "config.json"))
            save_model(built, str(Path(written) / "model.safetensors"), metadata={"format": "pt"})
            return cast(nn.Module, load(written, **options))
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise SkyliftConfigError("recipe.lora needs the peft package", hint=_INSTALL_HINT) from None
    return peft

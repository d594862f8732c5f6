"""A model built on the meta device and sharded (FSDP2), filled from a weights folder:
each rank reads only its rows of each tensor from the safetensors files, so no rank ever
holds the whole model; the buffers no checkpoint holds are recomputed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from skylift.errors import SkyliftConfigError

__all__ = ["load_local_shards", "local_part", "rebuild_non_persistent_buffers"]


def rebuild_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute the buffers a checkpoint does not hold (a rotary embedding's frequencies)
    after ``to_empty`` left them uninitialised: a Hugging Face model's ``_init_weights``
    knows them; with the random generators forked, so the run's draws stay the same.

    Raises:
        SkyliftConfigError: the model has such buffers and no ``_init_weights`` for them.
    """
    owners = [module for module in model.modules() if module._non_persistent_buffers_set]
    if not owners:
        return
    initialise = getattr(model, "_init_weights", None)
    if not callable(initialise):
        names = sorted({type(module).__name__ for module in owners})
        raise SkyliftConfigError(f"{type(model).__name__} built on the meta device has buffers no checkpoint holds "
                                 f"(in {', '.join(names)}) and no _init_weights to recompute them",
                                 hint="Build the model on a real device (a recipe without weights_source).")
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for module in owners:
            initialise(module)


def load_local_shards(model: nn.Module, folder: Path,
                      rename: Callable[[str], str | None] = lambda name: name) -> int:
    """Fill the sharded ``model``'s parameters and persistent buffers from the safetensors
    files of ``folder``, by name (``rename``: the model's name to the files'; None leaves
    the tensor to its owner), reading only the rows of each tensor this rank holds (a
    DTensor sharded on dim 0 as FSDP2 shards: chunks of ceil(rows / ranks)). A tied
    parameter is found under any of its names. Returns how many tensors were loaded.

    Raises:
        SkyliftConfigError: a parameter or buffer is in none of the files (names listed).
    """
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), path))
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for model_name, tensor in _persistent_tensors(model):
        name = rename(model_name)
        if name is not None:
            names.setdefault(id(tensor), []).append(name)
            tensors[id(tensor)] = tensor
    chosen = {key: next((name for name in group if name in where), None) for key, group in names.items()}
    missing = sorted(names[key][0] for key, name in chosen.items() if name is None)
    if missing:
        raise SkyliftConfigError(f"the weights folder {folder} holds no tensor for {', '.join(missing[:8])}"
                                 + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""),
                                 hint="Point the recipe at the folder save_pretrained wrote for this model.")
    by_file: dict[Path, list[tuple[str, torch.Tensor]]] = {}
    for key, chosen_name in chosen.items():
        if chosen_name is not None:  # every one is: a missing name was refused above
            by_file.setdefault(where[chosen_name], []).append((chosen_name, tensors[key]))
    with torch.no_grad():
        for path, entries in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for name, tensor in entries:
                    local_part(tensor).copy_(_rows_of_this_rank(handle, name, tensor))
    return len(chosen)


def _persistent_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``state_dict(keep_vars=True)`` names, without its hooks (a LoRA model's leave
    the frozen base out, and the base is what the folder holds)."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        dotted = f"{prefix}." if prefix else ""
        for name, parameter in module._parameters.items():
            if parameter is not None:
                yield dotted + name, parameter
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield dotted + name, buffer


def _rows_of_this_rank(handle: Any, name: str, tensor: torch.Tensor) -> torch.Tensor:
    mesh = getattr(tensor, "device_mesh", None)
    if mesh is None or tensor.dim() == 0:
        return handle.get_tensor(name)
    rows = tensor.shape[0]  # the global shape
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    stop = min(start + chunk, rows)
    assert local_part(tensor).shape[0] == stop - start, f"{name}: FSDP's shard is not rows {start}:{stop}"
    return handle.get_slice(name)[start:stop]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a ``DTensor`` (the same storage), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor

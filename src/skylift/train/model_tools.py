"""Model transformations the runtime applies: activation checkpointing."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, module_types: list[str]) -> int:
    """Recompute the activations of submodules whose class name is in ``module_types``.

    Models with their own switch (Hugging Face ``activation_checkpointing_enable``) use
    it, since it knows which layers are safe to recompute. Returns how many modules
    were wrapped.

    Raises:
        ValueError: no submodule matched, so the setting would do nothing.
    """
    # transformers 5.x names it activation_checkpointing_enable (the old name warns, and goes in v6).
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return 1
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if callable(enable):
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return 1
    wanted = set(module_types)
    matched = [module for module in model.modules() if type(module).__name__ in wanted]
    if not matched:
        present = sorted({type(module).__name__ for module in model.modules()})
        raise ValueError(
            f"activation_checkpointing.module_types {sorted(wanted)} matched no submodule of "
            f"{type(model).__name__}; its module types are: {', '.join(present)}"
        )
    for module in matched:
        module.forward = functools.partial(_checkpointed_forward, module.forward)
    return len(matched)


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant checkpointing works with DDP, torch.compile and inputs that do not
    # require grad, which the reentrant variant does not.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)

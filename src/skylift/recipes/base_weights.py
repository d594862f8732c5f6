"""What a checkpoint does not hold but depends on: the frozen base of an adapter run.

A LoRA or QLoRA checkpoint holds the adapters (and ``modules_to_save``) only; a resume
builds the base again from ``recipe.model_path``. A base re-saved into the same folder
(another fine-tune, another revision) would load without complaint and the adapters
would continue over weights they were never trained on. Every manifest records
:func:`frozen_base_facts`, and a resume whose base differs is refused
(:mod:`skylift.checkpoint.compatibility`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

__all__ = ["SAMPLED_BYTES", "WEIGHT_SUFFIXES", "frozen_base_facts", "weights_fingerprint"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLED_BYTES = 1 << 20
"""Read from each end of each weight file. A safetensors file starts with its header
(names, shapes, offsets) and the first tensors' bytes, and ends with the last tensors':
weights saved again after any training differ there, and reading 2 MiB a file keeps the
fingerprint to milliseconds on a 16 GB model (a full hash would read it all on every
start). A copy to another machine keeps the fingerprint: no time stamp is in it."""


def weights_fingerprint(folder: Path) -> str:
    """A BLAKE2b digest of ``folder``'s weight files: each one's name, size, first and
    last :data:`SAMPLED_BYTES`, in name order, and ``config.json`` whole."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(folder.iterdir()):
        if not path.is_file() or not (path.suffix in WEIGHT_SUFFIXES or path.name == "config.json"):
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(SAMPLED_BYTES))
            if size > SAMPLED_BYTES:
                handle.seek(max(size - SAMPLED_BYTES, SAMPLED_BYTES))
                digest.update(handle.read())
    return digest.hexdigest()


def frozen_base_facts(config: Any) -> dict[str, str]:
    """``{"base_weights": fingerprint}`` for a run whose checkpoints leave a frozen base out
    (``causal_lm`` with ``recipe.lora`` over a model folder); ``{}`` otherwise (the built-in
    tiny Llama is its seed, which the config records)."""
    if getattr(config.recipe, "name", None) != "causal_lm":
        return {}
    from skylift.recipes import check_recipe_settings
    from skylift.recipes.settings.causal_lm import TINY_LLAMA

    settings = check_recipe_settings(config)
    if settings.lora is None or settings.model_path == TINY_LLAMA:
        return {}
    folder = Path(settings.model_path).expanduser()
    return {"base_weights": weights_fingerprint(folder)} if folder.is_dir() else {}

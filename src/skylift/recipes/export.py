"""A run's trained model as a Hugging Face folder (``skylift export RUN_DIR --to hf OUT``).

Which weights: ``RUN_DIR/model.safetensors``, the final weights, when the run's
``summary.json`` says it reached at least the newest committed checkpoint's step (the
final weights are written after the last step, so no checkpoint is newer; they are what
the run evaluated, the moving average under ``optim.ema_decay``). Otherwise the newest
complete checkpoint: a run that was killed, or is still training, has checkpoints newer
than any final weights, or none. A checkpoint is read in either layout (DDP's whole
model, or FSDP's shards, assembled), each file verified against its manifest; the
optimizer state is never read.

The recipe writes the folder (:meth:`~skylift.recipes.base.Recipe.export_pretrained`);
it is written beside ``OUT`` and renamed into place, so ``OUT`` is never half written.
"""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file

from skylift.checkpoint.consolidate import full_model_state, newest_resumable_step
from skylift.config.load import load_config
from skylift.errors import SkyliftConfigError
from skylift.recipes import build_recipe, recipe_class
from skylift.recipes.base import Recipe
from skylift.storage import open_store

__all__ = ["DTYPES", "ExportResult", "export_run"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``--dtype`` names: fp32 gives the trained weights exactly (the master weights are fp32)."""

Source = Literal["auto", "final", "checkpoint"]


@dataclass
class ExportResult:
    """What ``skylift export`` wrote, and from which weights (``--json`` prints it)."""

    out_dir: str
    source: str
    """``final`` (``RUN_DIR/model.safetensors``) or ``checkpoint``."""
    step: int | None
    """The optimizer step of the weights (``None``: final weights of a run without summary.json)."""
    reason: str
    """Why these weights were chosen."""
    dtype: str
    recipe: str
    files: list[str] = field(default_factory=list)
    layout: str = "model"
    """``model`` (the whole model), ``adapters`` (a PEFT adapter folder: load it over the
    base with ``PeftModel.from_pretrained``) or ``merged`` (the adapters merged into the base)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def export_run(run_dir: Path, out_dir: Path, *, source: Source = "auto", dtype: str = "fp32",
               overrides: tuple[str, ...] = (), force: bool = False, merged: bool = False) -> ExportResult:
    """Write the run's newest trained weights (see the module's docstring) to ``out_dir``
    in the recipe's own format, with ``dtype`` weights. A run that trained adapters
    (``recipe.lora``) gives PEFT's adapter folder, or with ``merged`` the model with the
    adapters merged in.

    Raises:
        SkyliftConfigError: ``run_dir`` is not a run folder, its recipe cannot export,
            ``out_dir`` exists (without ``force``), or it holds no weights to export.
        CorruptCheckpointError: ``source="checkpoint"`` and no checkpoint verifies.
        StorageError: a checkpoint could not be read (no older one is taken instead).
    """
    config = _run_config(run_dir, overrides)
    if recipe_class(config).export_pretrained is Recipe.export_pretrained:
        raise SkyliftConfigError(f"recipe.name: {config.recipe.name} in {run_dir} does not export a Hugging Face "
                                 "folder", hint="Export runs of recipe causal_lm, or a recipe of your own that "
                                 "defines export_pretrained; the weights are in RUN_DIR/model.safetensors")  # fmt: skip
    if dtype not in DTYPES:
        raise SkyliftConfigError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if merged and "merged" not in inspect.signature(recipe_class(config).export_pretrained).parameters:
        raise SkyliftConfigError(f"--merged: recipe {config.recipe.name} trains no adapters to merge",
                                 hint="Export without --merged")
    _refuse_existing(out_dir, force)
    chosen, step, reason, weights = _weights(run_dir, config, source)
    recipe = build_recipe(config)
    staging = out_dir.with_name(f".{out_dir.name}.export-tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # Only asked of a recipe when set: a recipe of the user's need not know the keyword.
        flags = {"merged": True} if merged else {}
        written = recipe.export_pretrained(weights, staging, dtype=DTYPES[dtype], **flags)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ExportResult(str(out_dir), chosen, step, reason, dtype, config.recipe.name,
                        [str(out_dir / path.name) for path in written], _layout(config, merged))


def _layout(config: Any, merged: bool) -> str:
    adapters = (config.recipe.model_extra or {}).get("lora") is not None
    return "adapters" if adapters and not merged else "merged" if adapters else "model"


def _run_config(run_dir: Path, overrides: tuple[str, ...]) -> Any:
    path = run_dir / "config.yaml"
    if not path.is_file():
        what = "does not exist" if not run_dir.exists() else "holds no config.yaml"
        raise SkyliftConfigError(f"RUN_DIR: {run_dir} {what}, so it is not a run folder",
                                 hint="Pass the folder a run wrote (run_dir in its config), e.g. runs/causal-lm-cpu")
    return load_config(path, overrides)


def _refuse_existing(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not force and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise SkyliftConfigError(f"OUT: {out_dir} exists and is not empty",
                                 hint="Choose another folder, or pass --force to replace it")


def _weights(run_dir: Path, config: Any, source: Source) -> tuple[str, int | None, str, dict[str, torch.Tensor]]:
    """(source, step, reason, state dict) of the weights to export."""
    root, endpoint_url = config.checkpoint.root or str(run_dir / "checkpoints"), config.checkpoint.endpoint_url
    # Of the current timeline (a rollback's abandoned steps are not the newest); listed only, the read verifies.
    newest = newest_resumable_step(open_store(root, endpoint_url=endpoint_url))
    final_path, final_step = run_dir / "model.safetensors", _summary_step(run_dir)
    final_is_newest = final_path.is_file() and final_step is not None and (newest is None or final_step >= newest)
    if source == "final" or (source == "auto" and final_is_newest):
        return "final", final_step, _final_reason(final_path, final_step, newest, config), _load_final(final_path)
    if newest is None:
        raise SkyliftConfigError(
            f"RUN_DIR: {run_dir} holds no final weights newer than a checkpoint (model.safetensors and "
            f"summary.json), and {root} no committed checkpoint", hint="Let the run save one (checkpoint.enabled, "
            "checkpoint.every_steps) or finish (checkpoint.save_final_model), then export again")  # fmt: skip
    step, weights = full_model_state(root, endpoint_url=endpoint_url)
    if source == "checkpoint":
        return "checkpoint", step, "asked for (--source checkpoint): the newest complete checkpoint", weights
    if not final_path.is_file():
        older = "the run wrote no final weights (still training, or stopped before the end)"
    elif final_step is None:
        older = "model.safetensors has no summary.json to say its step (a run that did not finish)"
    else:
        older = f"the final weights are of step {final_step}, older"
    return "checkpoint", step, f"the newest complete checkpoint; {older}", weights


def _final_reason(path: Path, step: int | None, newest: int | None, config: Any) -> str:
    if step is None:
        return f"asked for (--source final); {path.parent}/summary.json is missing, so its step is unknown"
    ema = " (the moving average of the weights, optim.ema_decay)" if config.optim.ema_decay else ""
    newer = "no checkpoint" if newest is None else f"the newest checkpoint is of step {newest}"
    return f"the run's final weights{ema}, written after step {step}; {newer}"


def _load_final(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise SkyliftConfigError(f"--source final: {path} does not exist",
                                 hint="Export the newest checkpoint: --source checkpoint (or auto)")
    return load_file(str(path))


def _summary_step(run_dir: Path) -> int | None:
    path = run_dir / "summary.json"
    return int(json.loads(path.read_text())["steps"]) if path.is_file() else None

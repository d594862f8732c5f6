"""``causal_lm``'s settings (torch-free)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from skylift.errors import SkyliftConfigError
from skylift.recipes.settings.base import RecipeSettings

__all__ = ["TINY_LLAMA", "CausalLMSettings"]

TINY_LLAMA = "builtin:tiny-llama"
"""``recipe.model_path`` of the built-in tiny Llama (:mod:`skylift.recipes.tiny_lm`)."""


class CausalLMSettings(RecipeSettings):
    """``recipe`` of ``causal_lm``: a Hugging Face causal language model fine-tuned on JSONL documents."""

    model_path: str = Field(min_length=1)
    """The model and tokenizer: a local Hugging Face folder that ``save_pretrained`` wrote
    (``config.json``, safetensors weights, tokenizer files) for ``AutoModelForCausalLM``
    and ``AutoTokenizer``, read offline and never downloaded; or ``builtin:tiny-llama``,
    a 2-layer Llama of 0.15 M parameters initialised from the run's seed, with a
    byte-level BPE tokenizer trained on skylift's generated corpus (the CPU preset's
    model: it trains from scratch, in seconds)."""
    train_path: str = Field(min_length=1)
    """The training documents: a JSONL file whose rows hold ``text`` (every token
    learned) or ``prompt`` and ``completion`` (only the completion's tokens learned)."""
    val_path: str | None = None
    """Validation documents in the same form; ``null`` holds out ``data.val_fraction`` of
    the training documents (a seeded draw)."""
    sequence_length: int = Field(default=2048, ge=8, le=1_048_576)
    """Tokens per training sequence: the length of each packed block, or, unpacked, the
    longest document kept (longer ones are cut there; the run logs how many)."""
    packing: bool = True
    """Concatenate the documents and cut them into blocks of ``sequence_length`` (no
    padding; attention crosses document boundaries inside a block). ``false``: one
    document per sequence, padded per batch; needed with ``data.batching: token_budget``."""
    mask_prompt: bool = True
    """Leave a ``prompt``'s tokens out of the loss (labels -100), so only the completion is
    learned; ``false`` learns the prompt too."""

    def check_run(self, config: Any) -> None:
        """JSONL files, not streamed shards; token-budget batching of unpacked documents that fit it."""
        data = config.data
        if data.url or data.val_url:
            raise SkyliftConfigError("data.url: causal_lm reads JSONL files (recipe.train_path, val_path), not "
                                     "streamed shards", hint="Remove data.url and data.val_url")  # fmt: skip
        if data.batching == "token_budget" and self.packing:
            raise SkyliftConfigError(
                "recipe.packing: packed blocks all hold recipe.sequence_length tokens, so data.batching: "
                "token_budget has nothing to sort", hint="Set recipe.packing: false, or data.batching: fixed")
        if data.batching == "token_budget" and self.sequence_length > data.max_tokens:
            raise SkyliftConfigError(
                f"recipe.sequence_length ({self.sequence_length}) exceeds data.max_tokens ({data.max_tokens}): "
                "the longest document would not fit a micro-batch", hint="Raise data.max_tokens or lower "
                "recipe.sequence_length")  # fmt: skip

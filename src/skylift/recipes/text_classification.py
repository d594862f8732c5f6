"""Text classification: fine-tune the pretrained MiniLM-L6 encoder with a linear head.

Texts are tokenized once with the model's own WordPiece tokenizer and kept in memory
as unpadded token ids; batches are padded when they are formed: to ``data.max_length``
with ``batching: fixed``, to the batch's longest text with ``batching: token_budget``
and in evaluation (whose set is sorted by length, so its batches waste little).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skylift.config.schema import RunConfig
from skylift.data.datasets import DatasetSplit, stratified_split
from skylift.data.text import (
    TokenizedText,
    pad_collate,
    read_text_file,
    synthetic_reviews,
)
from skylift.recipes.base import Recipe, classification_sums

__all__ = ["TextClassification"]

log = logging.getLogger("skylift")


class TextClassification(Recipe):
    """Cross-entropy over classes; reports validation loss and accuracy.

    The loss of a micro-batch is its mean over samples; with token-budget batching the
    micro-batches hold different sample counts and each weighs the same in a step.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.pad_id = 0

    def build_datasets(self) -> DatasetSplit:
        from skylift.recipes.minilm import load_tokenizer

        data = self.config.data
        if data.dataset == "text_file":
            texts, labels, classes = read_text_file(Path(data.text_path or ""))
        else:
            texts, labels = synthetic_reviews(data.num_samples, self.config.seed)
            classes = ["negative", "positive"]
        tokenizer = load_tokenizer(data.max_length)
        self.pad_id = tokenizer.token_to_id("[PAD]")
        tokenized = TokenizedText.from_texts(tokenizer, texts, labels)
        train_index, val_index = stratified_split(tokenized.labels, data.val_fraction, self.config.seed)
        # Evaluation order does not matter (it sums over every sample): sorted by length,
        # each evaluation batch holds texts of similar length and little padding.
        val_index = sorted(val_index.tolist(), key=lambda index: tokenized.lengths[index])
        train, val = tokenized.subset(train_index.tolist()), tokenized.subset(val_index)
        log.info("text: %d training and %d validation texts, %d classes, mean %.1f tokens",
                 len(train), len(val), len(classes), sum(train.lengths) / len(train))  # fmt: skip
        return DatasetSplit(train=train, val=val, num_classes=len(classes), in_channels=0)

    def build_model(self, data: DatasetSplit) -> nn.Module:
        from skylift.recipes.minilm import MiniLMClassifier, load_minilm_encoder

        spec = self.config.model
        return MiniLMClassifier(load_minilm_encoder(), spec.num_classes or data.num_classes, pooling=spec.pooling)

    def collate(self, train: bool) -> Any:
        fixed_length = train and self.config.data.batching == "fixed"
        return pad_collate(self.config.data.max_length if fixed_length else None, self.pad_id)

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        return F.cross_entropy(model(input_ids, attention_mask), labels)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        input_ids, attention_mask, labels = batch
        return classification_sums(model(input_ids, attention_mask), labels)

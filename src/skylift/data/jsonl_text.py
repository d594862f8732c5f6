"""Causal language-model data: JSONL documents, prompt masks, packing and padding.

A JSONL row is a document: ``{"text": ...}`` (every token is a target), or
``{"prompt": ..., "completion": ...}`` (only the completion's tokens are targets: the
prompt's labels are ``-100``, which the loss ignores). A document's token ids end with
the tokenizer's end-of-sequence token, so the model learns where a document stops. Or
``{"messages": [{"role": ..., "content": ...}, ...]}``, a chat, rendered by the
tokenizer's chat template with the assistant turns as targets (:mod:`skylift.data.chat`;
the template ends it). A file holds chat rows or the other two, not both.

Three ways to cut documents into training sequences:

- :class:`PackedDocuments` (packing, the default) places several documents in one
  sequence of at most ``sequence_length`` positions, each attending only to itself: the
  per-document position ids restart at 0, and transformers builds the block-diagonal
  causal mask from them (``masking_utils.find_packed_sequence_indices``; flash attention
  takes them as variable-length sequences). No position predicts across a boundary: a
  document contributes its inputs ``ids[:-1]`` and labels ``ids[1:]``, so its last input
  predicts its own end-of-sequence token and the next document's first token is an input
  only. Documents are placed by best-fit decreasing (deterministic); a document longer
  than ``sequence_length`` is split into pieces of ``sequence_length`` positions (one
  token of overlap, so every token is predicted once), each piece its own document.
- :class:`PackedBlocks` (``packing_across_documents``) concatenates the documents and
  cuts the stream into blocks of ``sequence_length`` inputs, each with the next token of
  every position as its label (HF ``run_clm.py``'s ``group_texts``, torchtitan's
  packing). Every token except the stream's first is a target exactly once; the tail
  shorter than a block is dropped. Attention and prediction cross the documents inside a
  block, as in those references: for a corpus whose rows are pieces of longer texts.
- :class:`DocumentSequences` keeps one document per sequence (truncated to
  ``sequence_length``), with its length for token-budget batching; batches are padded
  to their longest sequence (:func:`causal_collate`).

Labels are stored already shifted (``labels[t]`` is the target after ``input_ids[t]``),
so the loss is a plain cross-entropy over positions.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from skylift.data.chat import (
    Conversation,
    assistant_token_mask,
    check_chat_template,
    has_generation_blocks,
    read_conversation,
)
from skylift.errors import SkyliftConfigError

__all__ = [
    "IGNORE_INDEX",
    "DocumentSequences",
    "EncodedDocument",
    "PackedBlocks",
    "PackedDocuments",
    "Row",
    "best_fit_decreasing",
    "causal_collate",
    "encode_conversations",
    "encode_documents",
    "packed_collate",
    "read_document_row",
    "read_jsonl_documents",
]

IGNORE_INDEX = -100
"""The label of a position that carries no loss (``torch.nn.functional.cross_entropy``'s default)."""

Encode = Callable[[list[str], bool], list[list[int]]]
"""Texts -> token ids; the flag says whether to add the tokenizer's leading special tokens."""

Row = dict[str, str] | Conversation
"""A document as read: ``text``, or ``prompt`` and ``completion``; or a chat."""


@dataclass(frozen=True)
class EncodedDocument:
    ids: list[int]
    targets: list[bool]
    """Per token: whether predicting it counts in the loss (False for a prompt's tokens)."""


def read_jsonl_documents(path: Path, field: str) -> list[Row]:
    """The rows of the JSONL file ``path`` (named by the config key ``field``), each with
    ``text`` or with ``prompt`` and ``completion``, all strings; or each a chat
    (``messages``, :func:`skylift.data.chat.read_conversation`).

    Raises:
        SkyliftConfigError: the file is missing or empty, a row is not such an object, or
            the file mixes chat rows with the others (naming the file, the line and what
            it holds).
    """
    if not path.is_file():
        raise SkyliftConfigError(f"{field}: {path} is not a file",
                                 hint="Point it at a JSONL file of {\"text\": ...}, {\"prompt\": ..., "
                                      "\"completion\": ...} or {\"messages\": [...]} rows")  # fmt: skip
    rows: list[Row] = []
    first_chat: tuple[int, bool] | None = None  # the first row's line, and whether it is a chat
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{field}: {path}:{number}"
            row = _document(line, where)
            chat = isinstance(row, Conversation)
            if first_chat is None:
                first_chat = (number, chat)
            elif chat != first_chat[1]:
                kinds = ("a text or prompt/completion row", "a chat (\"messages\") row")
                raise SkyliftConfigError(
                    f"{where}: {kinds[chat]} in a file whose first row (line {first_chat[0]}) is "
                    f"{kinds[first_chat[1]]}: a file holds chat rows, or text and prompt/completion rows, not both",
                    hint="Write every row of the file in one layout")  # fmt: skip
            rows.append(row)
    if not rows:
        raise SkyliftConfigError(f"{field}: {path} holds no rows")
    return rows


def _document(line: str, where: str) -> Row:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise SkyliftConfigError(f"{where}: not JSON ({error.msg})") from None
    return read_document_row(row, where)


def read_document_row(row: Any, where: str) -> Row:
    """One document, checked: an object with ``text``, or ``prompt`` and ``completion``
    (strings), or ``messages`` (a chat), as a JSONL line or a table's row holds it.

    Raises:
        SkyliftConfigError: naming ``where`` (the file and row) and what the row holds.
    """
    keys = set(row) if isinstance(row, dict) else set()
    wanted: tuple[str, ...]
    if "messages" in keys:
        if keys & {"text", "prompt", "completion"}:
            raise SkyliftConfigError(f"{where}: a row holds \"messages\" or \"text\" or \"prompt\" and "
                                     f"\"completion\", not several (found {sorted(keys)})")  # fmt: skip
        return read_conversation(row["messages"], where)
    if keys >= {"prompt", "completion"}:
        wanted = ("prompt", "completion")
    elif "text" in keys:
        wanted = ("text",)
    else:
        preference = keys >= {"chosen", "rejected"}
        raise SkyliftConfigError(f"{where}: a row needs \"text\", or \"prompt\" and \"completion\", or "
                                 f"\"messages\" (found {sorted(keys) if keys else type(row).__name__})",
                                 hint="Preference rows (chosen and rejected) are learned with recipe.objective: dpo"
                                 if preference else None)  # fmt: skip
    for key in wanted:
        if not isinstance(row[key], str):
            raise SkyliftConfigError(f"{where}: \"{key}\" must be a string, not {type(row[key]).__name__}")
    return {key: row[key] for key in wanted}


def encode_conversations(conversations: Sequence[Conversation], tokenizer: Any, field: str, *,
                         mask_prompt: bool = True) -> list[EncodedDocument]:
    """Token ids and target flags of each chat, as ``tokenizer``'s chat template renders
    it: the assistant turns' tokens are targets (every token with ``mask_prompt=False``).

    Raises:
        SkyliftConfigError: the tokenizer has no chat template (naming ``field``), or one
            that cannot place a row's assistant turns (naming the row).
    """
    marked = has_generation_blocks(check_chat_template(tokenizer, field))
    documents = []
    for conversation in conversations:
        ids, assistant = assistant_token_mask(tokenizer, conversation, marked=marked)
        documents.append(EncodedDocument(ids, assistant if mask_prompt else [True] * len(ids)))
    return documents


def encode_documents(rows: Sequence[dict[str, str]], encode: Encode, eos_id: int, *,
                     mask_prompt: bool = True) -> list[EncodedDocument]:
    """Token ids and target flags of each row. The first segment (``text`` or ``prompt``)
    gets the tokenizer's leading special tokens (Llama's ``<|begin_of_text|>``), the
    completion none; ``eos_id`` ends every document. Prompt and completion are encoded
    apart, so the boundary between them is a token boundary.

    ``mask_prompt=False`` keeps the prompt's tokens as targets too."""
    firsts = encode([row.get("text", row.get("prompt", "")) for row in rows], True)
    completions = iter(encode([row["completion"] for row in rows if "completion" in row], False))
    documents = []
    for row, first in zip(rows, firsts, strict=True):
        if "completion" in row:
            completion = [*next(completions), eos_id]
            targets = [not mask_prompt] * len(first) + [True] * len(completion)
            documents.append(EncodedDocument([*first, *completion], targets))
        else:
            documents.append(EncodedDocument([*first, eos_id], [True] * (len(first) + 1)))
    return documents


def _labels(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``ids`` where ``targets`` holds, else :data:`IGNORE_INDEX`."""
    return torch.where(targets, ids, torch.full_like(ids, IGNORE_INDEX))


class PackedBlocks(Dataset):
    """The documents as one token stream cut into blocks of ``sequence_length`` positions
    (``recipe.packing_across_documents``: attention crosses documents).

    Block ``i`` reads stream tokens ``[iL, (i+1)L)`` and predicts ``[iL+1, (i+1)L]``:
    consecutive blocks overlap by one token, so no prediction is lost at a block edge.

    Raises:
        SkyliftConfigError: the documents hold fewer than ``sequence_length + 1`` tokens.
    """

    def __init__(self, documents: Sequence[EncodedDocument], sequence_length: int, *, field: str) -> None:
        stream = torch.tensor([token for document in documents for token in document.ids], dtype=torch.long)
        targets = torch.tensor([flag for document in documents for flag in document.targets], dtype=torch.bool)
        num_blocks = (len(stream) - 1) // sequence_length
        if num_blocks < 1:
            raise SkyliftConfigError(
                f"{field}: {len(stream)} tokens do not fill one block of recipe.sequence_length "
                f"({sequence_length}) + 1", hint="Give more data or lower recipe.sequence_length")  # fmt: skip
        used = num_blocks * sequence_length
        self.input_ids = stream[:used].view(num_blocks, sequence_length)
        self.labels = _labels(stream[1 : used + 1], targets[1 : used + 1]).view(num_blocks, sequence_length)
        self.dropped_tokens = len(stream) - used - 1

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[index], self.labels[index]


class PackedDocuments(Dataset):
    """Documents packed into sequences of at most ``sequence_length`` positions, each
    document attending only to itself (see the module's docstring).

    Item ``i`` is ``(input_ids, labels, position_ids)``; ``document_lengths[i]`` lists the
    positions of each document it holds, in order. ``split_documents`` counts the
    documents cut into pieces; documents of a single token (nothing to predict) are left out.

    Raises:
        SkyliftConfigError: no document holds two tokens, so there is nothing to predict.
    """

    def __init__(self, documents: Sequence[EncodedDocument], sequence_length: int, *, field: str) -> None:
        pieces: list[tuple[list[int], list[bool]]] = []
        self.split_documents = 0
        for document in documents:
            predictions = len(document.ids) - 1
            self.split_documents += predictions > sequence_length
            # Piece k reads ids[kL : kL+L] and predicts ids[kL+1 : kL+L+1]: one token of overlap.
            for start in range(0, predictions, sequence_length):
                stop = start + sequence_length + 1
                pieces.append((document.ids[start:stop], document.targets[start:stop]))
        if not pieces:
            raise SkyliftConfigError(f"{field}: no document holds two tokens, so there is nothing to predict",
                                     hint="Give documents with text in them")  # fmt: skip
        self.sequences: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.document_lengths: list[list[int]] = []
        for members in best_fit_decreasing([len(ids) - 1 for ids, _ in pieces], sequence_length):
            ids = [torch.tensor(pieces[index][0], dtype=torch.long) for index in members]
            targets = [torch.tensor(pieces[index][1], dtype=torch.bool) for index in members]
            lengths = [len(piece) - 1 for piece in ids]
            labels = [_labels(piece[1:], flags[1:]) for piece, flags in zip(ids, targets, strict=True)]
            self.sequences.append((torch.cat([piece[:-1] for piece in ids]), torch.cat(labels),
                                   torch.cat([torch.arange(length) for length in lengths])))  # fmt: skip
            self.document_lengths.append(lengths)
        self.lengths = [len(inputs) for inputs, _, _ in self.sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.sequences[index]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` (each at most ``capacity``) grouped into bins of total at
    most ``capacity``: longest first (ties in index order), each into the open bin it
    fills fullest, else a new bin. Deterministic: the same lengths give the same bins
    (exact resume needs the same dataset indices). Bins in the order they were opened,
    each listing its indices in increasing order."""
    bins: list[list[int]] = []
    rooms: list[int] = []  # the distinct free capacities of open bins, sorted
    open_bins: dict[int, list[int]] = {}  # free capacity -> the open bins with that much room
    for index in sorted(range(len(lengths)), key=lambda item: (-lengths[item], item)):
        length = lengths[index]
        at = bisect.bisect_left(rooms, length)
        if at == len(rooms):
            chosen, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[at]
            chosen = open_bins[room].pop()
            if not open_bins[room]:
                del open_bins[room]
                rooms.pop(at)
        bins[chosen].append(index)
        left = room - length
        if left > 0:
            if left not in open_bins:
                bisect.insort(rooms, left)
                open_bins[left] = []
            open_bins[left].append(chosen)
    return [sorted(members) for members in bins]


class DocumentSequences(Dataset):
    """One document per sequence: inputs ``ids[:-1]``, labels ``ids[1:]`` (masked),
    truncated to ``sequence_length`` positions; ``lengths`` for token-budget batching.
    Documents of a single token (nothing to predict) are left out."""

    def __init__(self, documents: Sequence[EncodedDocument], sequence_length: int) -> None:
        kept = [document for document in documents if len(document.ids) > 1]
        self.truncated = sum(len(document.ids) - 1 > sequence_length for document in kept)
        self.sequences: list[tuple[torch.Tensor, torch.Tensor]] = []
        for document in kept:
            ids = torch.tensor(document.ids[: sequence_length + 1], dtype=torch.long)
            targets = torch.tensor(document.targets[: sequence_length + 1], dtype=torch.bool)
            self.sequences.append((ids[:-1], _labels(ids[1:], targets[1:])))
        self.lengths = [len(inputs) for inputs, _ in self.sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sequences[index]

    def subset(self, indices: Sequence[int]) -> DocumentSequences:
        """The sequences at ``indices``, in that order."""
        chosen = DocumentSequences([], 1)
        chosen.sequences = [self.sequences[index] for index in indices]
        chosen.lengths = [self.lengths[index] for index in indices]
        chosen.truncated = self.truncated
        return chosen


def causal_collate(pad_id: int) -> Callable[[list[tuple[torch.Tensor, torch.Tensor]]], Any]:
    """Join ``(input_ids, labels)`` pairs into ``(input_ids, attention_mask, labels)``,
    right-padded to the longest: inputs with ``pad_id``, labels with :data:`IGNORE_INDEX`
    (so padding never counts in the loss), attention mask 0 there."""

    def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
        longest = max(len(inputs) for inputs, _ in samples)
        input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, (inputs, targets) in enumerate(samples):
            input_ids[row, : len(inputs)] = inputs
            labels[row, : len(targets)] = targets
            attention_mask[row, : len(inputs)] = 1
        return input_ids, attention_mask, labels

    return collate


def packed_collate(pad_id: int) -> Callable[[list[tuple[torch.Tensor, ...]]], dict[str, torch.Tensor]]:
    """Join :class:`PackedDocuments` items into ``{"input_ids", "position_ids", "labels"}``,
    right-padded to the longest. The padding is one more document (positions from 0,
    labels :data:`IGNORE_INDEX`, inputs ``pad_id``): it attends only to itself and nothing
    attends to it, so no 2D attention mask is needed, and none is given: transformers
    reads packed documents from the position ids only when the attention mask is ``None``."""

    def collate(samples: list[tuple[torch.Tensor, ...]]) -> dict[str, torch.Tensor]:
        longest = max(len(inputs) for inputs, _, _ in samples)
        input_ids = torch.full((len(samples), longest), pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.arange(longest).repeat(len(samples), 1)
        for row, (inputs, targets, positions) in enumerate(samples):
            input_ids[row, : len(inputs)] = inputs
            labels[row, : len(targets)] = targets
            position_ids[row, : len(positions)] = positions
            position_ids[row, len(positions) :] = torch.arange(longest - len(positions))
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}

    return collate

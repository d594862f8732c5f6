"""Preference data for DPO: a prompt, a chosen and a rejected completion, kept together.

A JSONL row is ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (strings), or
``{"messages": [...], "chosen": ..., "rejected": ...}``: a chat (:mod:`skylift.data.chat`)
that the chosen or the rejected text continues as the assistant's next turn.

Each completion becomes one sequence, prompt tokens then completion tokens, labelled on
the completion only (the prompt's labels are -100), as TRL's ``DPOTrainer`` builds them:

- a ``prompt`` row: the prompt with the tokenizer's leading special tokens, the completion
  without, then end-of-sequence (:func:`~skylift.data.jsonl_text.encode_documents`'s
  layout; prompt and completion are tokenized apart, so their boundary is a token
  boundary);
- a chat: the chat template renders the messages with the chosen (or rejected) answer as
  the last assistant turn; the completion is what follows the longest prefix shared with
  the messages rendered with the generation prompt (TRL's ``common_prefix_length``).

A sample is the *pair* (:class:`PreferencePairs`), so no sampler, micro-batch or rank
ever holds one completion without the other; :func:`preference_collate` pads a batch of
B pairs to ``(B, 2, T)`` tensors (chosen at ``[:, 0]``, rejected at ``[:, 1]``), whose
first dimension counts pairs; the loss feeds the model the ``2B`` sequences chosen first,
then rejected (TRL's concatenated layout).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from skylift.data.chat import Conversation, check_chat_template, read_conversation
from skylift.data.jsonl_text import IGNORE_INDEX, EncodedDocument
from skylift.errors import SkyliftConfigError

__all__ = ["PreferencePairs", "PreferenceRow", "encode_preferences", "preference_collate", "read_preference_row",
           "read_preference_rows"]

PREFERENCE_LAYOUT = ('{"prompt": ..., "chosen": ..., "rejected": ...} or {"messages": [...], "chosen": ..., '
                     '"rejected": ...} rows')  # fmt: skip


@dataclass(frozen=True)
class PreferenceRow:
    """A preference as read: the prompt (a string, or a chat's messages), two completions."""

    prompt: str | Conversation
    chosen: str
    rejected: str


def read_preference_rows(path: Path, field: str) -> list[PreferenceRow]:
    """The rows of the JSONL file ``path`` (named by the config key ``field``).

    Raises:
        SkyliftConfigError: the file is missing or empty, or a row is not a preference
            (naming the file and line; rows of SFT data name ``recipe.objective``).
    """
    if not path.is_file():
        raise SkyliftConfigError(f"{field}: {path} is not a file", hint=f"Point it at a JSONL file of "
                                 f"{PREFERENCE_LAYOUT}")  # fmt: skip
    rows = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                rows.append(_preference(line, f"{field}: {path}:{number}"))
    if not rows:
        raise SkyliftConfigError(f"{field}: {path} holds no rows")
    return rows


def _preference(line: str, where: str) -> PreferenceRow:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise SkyliftConfigError(f"{where}: not JSON ({error.msg})") from None
    return read_preference_row(row, where)


def read_preference_row(row: Any, where: str) -> PreferenceRow:
    """One checked preference row (a JSONL line's object, a table's row), named ``where``
    in its errors.

    Raises:
        SkyliftConfigError: not a preference (SFT rows name ``recipe.objective``).
    """
    keys = set(row) if isinstance(row, dict) else set()
    if not keys >= {"chosen", "rejected"} or not keys & {"prompt", "messages"}:
        found = sorted(keys) if keys else type(row).__name__
        raise SkyliftConfigError(f"{where}: recipe.objective: dpo needs \"prompt\" (or \"messages\"), \"chosen\" "
                                 f"and \"rejected\" in every row (found {found})", hint="Give preference rows, or "
                                 "set recipe.objective: sft for text, prompt/completion and chat rows")  # fmt: skip
    if {"prompt", "messages"} <= keys:
        raise SkyliftConfigError(f"{where}: a preference row holds \"prompt\" or \"messages\", not both")
    for key in ("chosen", "rejected", *(("prompt",) if "prompt" in keys else ())):
        if not isinstance(row[key], str):
            raise SkyliftConfigError(f"{where}: \"{key}\" must be a string, not {type(row[key]).__name__}")
    prompt: str | Conversation
    if "messages" in keys:
        # The answers are the assistant's next turn: a placeholder one makes read_conversation's
        # "no assistant message" check pass for a chat that has none yet, and is cut off again.
        answered = read_conversation([*row["messages"], {"role": "assistant", "content": row["chosen"]}]
                                     if isinstance(row["messages"], list) else row["messages"], where)
        prompt = Conversation(answered.messages[:-1], where)
    else:
        prompt = row["prompt"]
    return PreferenceRow(prompt, row["chosen"], row["rejected"])


def encode_preferences(rows: Sequence[PreferenceRow], tokenizer: Any, field: str) -> list[tuple[EncodedDocument, ...]]:
    """Token ids and target flags of each row's (chosen, rejected) sequences: the prompt's
    tokens then the completion's, only the completion's targets (the module's docstring).

    Raises:
        SkyliftConfigError: chats and a tokenizer without a chat template (naming ``field``).
    """
    eos = int(tokenizer.eos_token_id)
    if any(isinstance(row.prompt, Conversation) for row in rows):
        check_chat_template(tokenizer, field)
    pairs = []
    for row in rows:
        if isinstance(row.prompt, Conversation):
            pairs.append(tuple(_chat_sequence(tokenizer, row.prompt, answer) for answer in (row.chosen, row.rejected)))
            continue
        prompt = list(tokenizer(row.prompt, add_special_tokens=True)["input_ids"])
        pair = []
        for answer in (row.chosen, row.rejected):
            completion = [*tokenizer(answer, add_special_tokens=False)["input_ids"], eos]
            pair.append(EncodedDocument([*prompt, *completion], [False] * len(prompt) + [True] * len(completion)))
        pairs.append(tuple(pair))
    return pairs


def _chat_sequence(tokenizer: Any, prompt: Conversation, answer: str) -> EncodedDocument:
    def render(messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                add_generation_prompt=generation_prompt)  # fmt: skip
        return list(encoded["input_ids"])

    messages = list(prompt.messages)
    prompt_ids = render(messages, True)
    ids = render([*messages, {"role": "assistant", "content": answer}], False)
    shared = next((index for index, (a, b) in enumerate(zip(prompt_ids, ids, strict=False)) if a != b),
                  min(len(prompt_ids), len(ids)))  # fmt: skip
    if shared >= len(ids):
        raise SkyliftConfigError(f"{prompt.where}: the chat template renders no token for the answer",
                                 hint="Check the tokenizer's chat_template renders the assistant's turns")
    return EncodedDocument(ids, [index >= shared for index in range(len(ids))])


def _shifted(document: EncodedDocument, sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(document.ids[: sequence_length + 1], dtype=torch.long)
    targets = torch.tensor(document.targets[: sequence_length + 1], dtype=torch.bool)
    labels = torch.where(targets[1:], ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))
    return ids[:-1], labels


class PreferencePairs(Dataset):
    """One pair per sample: ``(chosen_inputs, chosen_labels, rejected_inputs,
    rejected_labels)``, each sequence cut at ``sequence_length`` positions (labels
    shifted, as :class:`~skylift.data.jsonl_text.DocumentSequences`'). A pair that the cut
    leaves without a single completion token on either side is left out (``dropped``
    counts them): its loss would be a constant, log 2."""

    def __init__(self, pairs: Sequence[tuple[EncodedDocument, ...]], sequence_length: int) -> None:
        self.pairs: list[tuple[torch.Tensor, ...]] = []
        self.truncated = 0
        self.dropped = 0
        for chosen, rejected in pairs:
            self.truncated += sum(len(document.ids) - 1 > sequence_length for document in (chosen, rejected))
            chosen_inputs, chosen_labels = _shifted(chosen, sequence_length)
            rejected_inputs, rejected_labels = _shifted(rejected, sequence_length)
            if not ((chosen_labels != IGNORE_INDEX).any() and (rejected_labels != IGNORE_INDEX).any()):
                self.dropped += 1
                continue
            self.pairs.append((chosen_inputs, chosen_labels, rejected_inputs, rejected_labels))
        # What a pair takes of a micro-batch under data.batching: token_budget: both sides,
        # each padded to the longer (the batch is (B, 2, T)), so B x the longest length is
        # the batch's padded token count.
        self.lengths = [2 * max(len(pair[0]), len(pair[2])) for pair in self.pairs]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.pairs[index]


def preference_collate(pad_id: int) -> Callable[[list[tuple[torch.Tensor, ...]]], tuple[torch.Tensor, ...]]:
    """Join pairs into ``(input_ids, attention_mask, labels)`` of shape ``(B, 2, T)``:
    ``[:, 0]`` the chosen sequences, ``[:, 1]`` the rejected, right-padded to the batch's
    longest (inputs with ``pad_id``, labels with -100, attention mask 0 there). Slicing
    the first dimension keeps pairs whole."""

    def collate(samples: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        longest = max(len(sample[side]) for sample in samples for side in (0, 2))
        input_ids = torch.full((len(samples), 2, longest), pad_id, dtype=torch.long)
        labels = torch.full((len(samples), 2, longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), 2, longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            for side in (0, 1):
                inputs, targets = sample[2 * side], sample[2 * side + 1]
                input_ids[row, side, : len(inputs)] = inputs
                labels[row, side, : len(targets)] = targets
                attention_mask[row, side, : len(inputs)] = 1
        return input_ids, attention_mask, labels

    return collate

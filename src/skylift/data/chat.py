"""Chat data: ``messages`` rows rendered by the tokenizer's own chat template, assistant turns learned.

A chat row is ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``
(the OpenAI and Hugging Face layout). Its tokens are what the tokenizer's chat template
renders (``tokenizer.apply_chat_template``: the template places the special tokens, so
nothing is added around it), and only the assistant turns' tokens are targets.

Which tokens belong to an assistant turn, two ways:

- The template marks them with ``{% generation %} ... {% endgeneration %}`` blocks:
  Hugging Face's own mask (``return_assistant_tokens_mask=True``, what TRL's
  ``assistant_only_loss=True`` trains on, huggingface/trl#3586). A token counts when it
  overlaps a marked span.
- The template has no such blocks: each assistant turn ``i`` is the text that rendering
  ``messages[:i + 1]`` adds to ``messages[:i]`` rendered with the generation prompt (the
  assistant header), so the header stays a prompt and the turn's own end-of-turn marker is
  learned. That needs every such prefix to render as a prefix of the whole conversation;
  a template that renders earlier turns differently (one that drops past reasoning, say)
  is refused, naming the row. Tokens are assigned to spans by the same overlap rule.

Either way the tokens are those of the whole conversation tokenized once, so the labels
are those of the text the model reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skylift.errors import SkyliftConfigError

__all__ = ["ROLES", "Conversation", "assistant_token_mask", "check_chat_template", "has_generation_blocks",
           "read_conversation"]

ROLES = ("system", "user", "assistant")
"""The roles a message may have."""

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")

_FALLBACK_HINT = ("Mark the assistant turns with {% generation %} ... {% endgeneration %} in the tokenizer's "
                  "chat_template, or use prompt/completion rows")  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    """A chat row: its messages (``role`` and ``content``, both strings) and where it was
    read (``recipe.train_path: FILE:LINE``), for errors that name it."""

    messages: tuple[dict[str, str], ...]
    where: str


def read_conversation(messages: Any, where: str) -> Conversation:
    """The ``messages`` of a JSONL row, checked: a non-empty list of objects, each with a
    known ``role`` and a string ``content`` and nothing else, one of them the assistant's.

    Raises:
        SkyliftConfigError: naming ``where`` (the file and line), the message and the field.
    """
    if not isinstance(messages, list) or not messages:
        raise SkyliftConfigError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} "
                                 f"objects, not {_shown(messages)}")  # fmt: skip
    checked = []
    for index, message in enumerate(messages):
        field = f"{where}: messages[{index}]"
        if not isinstance(message, dict):
            raise SkyliftConfigError(f"{field} must be an object with \"role\" and \"content\", not "
                                     f"{type(message).__name__}")  # fmt: skip
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise SkyliftConfigError(f"{field} holds {extra}: a message has \"role\" and \"content\" only "
                                     "(tool calls and other fields are not supported)")  # fmt: skip
        role = message.get("role")
        if role not in ROLES:
            raise SkyliftConfigError(f"{field}.role is {_shown(role)}: it must be one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise SkyliftConfigError(f"{field}.content must be a string, not "
                                     f"{_shown(message.get('content'))}")  # fmt: skip
        checked.append({"role": role, "content": message["content"]})
    if not any(message["role"] == "assistant" for message in checked):
        raise SkyliftConfigError(f"{where}: \"messages\" has no assistant message, so nothing to learn")
    return Conversation(tuple(checked), where)


def _shown(value: Any) -> str:
    return "missing" if value is None else repr(value) if isinstance(value, str) else type(value).__name__


def check_chat_template(tokenizer: Any, field: str) -> str:
    """The tokenizer's chat template (a fast tokenizer's: the labels need its character offsets).

    Raises:
        SkyliftConfigError: the tokenizer has no chat template, or is not a fast one.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise SkyliftConfigError(f"{field}: chat rows (\"messages\") need the tokenizer's chat template, and the "
                                 "tokenizer of recipe.model_path has none", hint="Give the tokenizer a chat_template "
                                 "(set tokenizer.chat_template and save_pretrained the folder), or use "
                                 "prompt/completion or text rows")  # fmt: skip
    if not getattr(tokenizer, "is_fast", False):
        raise SkyliftConfigError(f"{field}: chat rows need a fast tokenizer (character offsets place the assistant "
                                 f"turns), and recipe.model_path's is {type(tokenizer).__name__}",
                                 hint="Save the model folder with a tokenizer.json (a fast tokenizer)")  # fmt: skip
    return str(tokenizer.get_chat_template())


def has_generation_blocks(template: str) -> bool:
    """Whether a chat template marks the assistant's text with ``{% generation %}``."""
    return _GENERATION_BLOCK.search(template) is not None


def assistant_token_mask(tokenizer: Any, conversation: Conversation, *, marked: bool) -> tuple[list[int], list[bool]]:
    """The conversation's token ids as the chat template (checked by
    :func:`check_chat_template`) renders them, and per token whether it belongs to an
    assistant turn: by the template's ``{% generation %}`` blocks when ``marked``
    (:func:`has_generation_blocks`), else by rendering prefixes (the module's docstring).

    Raises:
        SkyliftConfigError: the template fails on the row, gives it no assistant token, or
            (without generation blocks) does not render its prefixes as prefixes.
    """
    from jinja2 import TemplateError  # transformers' template engine (it depends on jinja2)

    messages = list(conversation.messages)
    try:
        if marked:
            encoded = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                    return_assistant_tokens_mask=True)  # fmt: skip
            ids, mask = list(encoded["input_ids"]), [bool(flag) for flag in encoded["assistant_masks"]]
        else:
            ids, mask = _mask_from_prefixes(tokenizer, messages, conversation.where)
    except SkyliftConfigError:
        raise
    except (TemplateError, TypeError, ValueError, KeyError) as error:  # a template's raise_exception, or its bugs
        raise SkyliftConfigError(f"{conversation.where}: the tokenizer's chat template fails on this row: "
                                 f"{type(error).__name__}: {error}".splitlines()[0]) from None  # fmt: skip
    if not any(mask):
        raise SkyliftConfigError(f"{conversation.where}: the chat template marks no token of this row as the "
                                 "assistant's", hint=_FALLBACK_HINT)  # fmt: skip
    return ids, mask


def _mask_from_prefixes(tokenizer: Any, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[bool]]:
    def render(part: Sequence[dict[str, str]], prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(list(part), tokenize=False, add_generation_prompt=prompt))

    text = render(messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, end = render(messages[:index], True), render(messages[: index + 1], False)
        if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
            raise SkyliftConfigError(
                f"{where}: the chat template has no {{% generation %}} blocks, and it renders the conversation up "
                f"to messages[{index}] (the assistant's) other than as the start of the whole one, so the turn's "
                "tokens cannot be told from their prefixes", hint=_FALLBACK_HINT)
        spans.append((len(start), len(end)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [_overlaps(offsets, spans) for offsets in encoded["offset_mapping"]]


def _overlaps(offsets: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    """Whether a token's characters ``[start, end)`` overlap one of ``spans`` (Hugging
    Face's rule for ``return_assistant_tokens_mask``)."""
    start, end = offsets
    return any(start < span_end and end > span_start for span_start, span_end in spans)

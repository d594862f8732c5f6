"""A tiny Llama, its tokenizer and a generated corpus: a causal-LM job that needs no download.

``recipe.model_path: builtin:tiny-llama`` is a 2-layer ``LlamaForCausalLM`` built
from its config class, initialised from the run's seed, with a byte-level BPE tokenizer
(the ``tokenizers`` library) trained on :func:`tiny_corpus`. Both are the same on every
rank and every run: the corpus is seeded, and BPE training on a fixed corpus is
deterministic (a test trains it twice and compares).

The corpus has structure a model this size learns in a few hundred steps: counting runs
(``count from 7: 7 8 9 10``, as ``text``), and two lookups as prompt and completion
(``colour of a lemon:`` -> `` yellow``; ``after 12 comes`` -> `` 13``), so the loss
falls visibly and the masked prompt tokens matter. ``examples/data/tiny-lm.jsonl`` is
this corpus (``python -m skylift.recipes.tiny_lm examples/data/tiny-lm.jsonl`` writes
it again; a test holds the two equal). :func:`write_tiny_lm` writes the model and
tokenizer as a Hugging Face folder, to use like any other.

The tokenizer has a chat template (:data:`CHAT_TEMPLATE`), and :func:`tiny_chats` the
same lookups as conversations, for chat fine-tuning offline:
``examples/data/tiny-chat.jsonl`` (``--chat PATH`` writes it again). :func:`tiny_preferences`
asks the lookups again as preference pairs, the right answer chosen and a wrong one
rejected, for DPO: ``examples/data/tiny-preferences.jsonl`` (``--preferences PATH``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

__all__ = ["CHAT_TEMPLATE", "COLOURS", "tiny_chats", "tiny_corpus", "tiny_llama", "tiny_llama_config",
           "tiny_preferences", "tiny_tokenizer", "write_corpus", "write_tiny_lm"]

COLOURS = {
    "lemon": "yellow", "banana": "yellow", "lime": "green", "leaf": "green", "frog": "green", "cherry": "red",
    "tomato": "red", "ruby": "red", "sky": "blue", "sea": "blue", "plum": "purple", "grape": "purple",
    "coal": "black", "crow": "black", "snow": "white", "milk": "white", "carrot": "orange", "pumpkin": "orange",
    "flamingo": "pink", "chocolate": "brown",
}  # fmt: skip
"""The colour lookup the corpus teaches."""

SPECIAL_TOKENS = {"pad_token": "<|pad|>", "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
"""Named as Llama 3 names its own (it has no padding token; this one is never a target)."""

VOCABULARY_SIZE = 512
"""BPE merges stop here, or when the corpus has no pair left to merge."""

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant\n' -}}{%- endif -%}"
)
"""The tiny tokenizer's chat template, laid out as Llama 3's: ``<|begin_of_text|>`` once,
then per message a header (the role), the content and an end-of-turn token; the
generation prompt is the assistant's header. Llama 3 spells the header
``<|start_header_id|>ROLE<|end_header_id|>\n\n`` and ends a turn with ``<|eot_id|>``;
here the header is ``ROLE\n`` and a turn ends with ``<|end_of_text|>``, tokens the
tokenizer has already, since three more would change the vocabulary, hence the model
drawn from a seed and every figure measured on it. The assistant's content and its
end-of-turn token are inside ``{% generation %}``: that token is learned, so the model
learns to stop (TRL's ``is_chat_template_stop_token_trained`` checks the same)."""


def tiny_corpus(num_rows: int = 3000, seed: int = 0) -> list[dict[str, str]]:
    """``num_rows`` documents, a third of each kind, as JSONL rows (seeded)."""
    draw = random.Random(seed)
    objects = sorted(COLOURS)
    rows: list[dict[str, str]] = []
    for index in range(num_rows):
        kind = index % 3
        if kind == 0:
            start = draw.randint(0, 60)
            run = " ".join(str(number) for number in range(start, start + draw.randint(3, 12)))
            rows.append({"text": f"count from {start}: {run}"})
        elif kind == 1:
            thing = draw.choice(objects)
            article = "an" if thing[0] in "aeiou" else "a"
            rows.append({"prompt": f"colour of {article} {thing}:", "completion": f" {COLOURS[thing]}"})
        else:
            number = draw.randint(0, 70)
            rows.append({"prompt": f"after {number} comes", "completion": f" {number + 1}"})
    return rows


def tiny_chats(num_rows: int = 1200, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """``num_rows`` conversations (``messages`` rows) of the corpus's lookups, seeded: half
    open with a system message, then 1 to 3 exchanges of a colour, a successor or a
    count; a successor may be followed by ``and then``, whose answer is one more, so a
    turn depends on an earlier one."""
    draw = random.Random(seed)
    objects = sorted(COLOURS)
    rows = []
    for _ in range(num_rows):
        messages = [{"role": "system", "content": "answer with colours and numbers"}] if draw.random() < 0.5 else []
        for _ in range(draw.randint(1, 3)):
            kind = draw.randrange(3)
            if kind == 0:
                thing = draw.choice(objects)
                article = "an" if thing[0] in "aeiou" else "a"
                exchange = [(f"colour of {article} {thing}:", COLOURS[thing])]
            elif kind == 1:
                number = draw.randint(0, 60)
                exchange = [(f"after {number} comes", str(number + 1))]
                if draw.random() < 0.5:
                    exchange.append(("and then", str(number + 2)))
            else:
                start = draw.randint(0, 60)
                stop = start + draw.randint(2, 6)
                exchange = [(f"count from {start} to {stop}", " ".join(str(n) for n in range(start, stop + 1)))]
            for question, answer in exchange:
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows


def tiny_preferences(num_rows: int = 600, seed: int = 0) -> list[dict[str, str]]:
    """``num_rows`` preference pairs (seeded), half colours and half successors:
    ``{"prompt": "colour of a lemon:", "chosen": " yellow", "rejected": " blue"}``, the
    rejected answer another colour, or a successor off by 2 to 5 either way."""
    draw = random.Random(seed)
    objects = sorted(COLOURS)
    colours = sorted(set(COLOURS.values()))
    rows = []
    for index in range(num_rows):
        if index % 2 == 0:
            thing = draw.choice(objects)
            article = "an" if thing[0] in "aeiou" else "a"
            wrong = draw.choice([colour for colour in colours if colour != COLOURS[thing]])
            rows.append({"prompt": f"colour of {article} {thing}:", "chosen": f" {COLOURS[thing]}",
                         "rejected": f" {wrong}"})
        else:
            number = draw.randint(5, 70)
            off = number + 1 + draw.choice([-5, -4, -3, -2, 2, 3, 4, 5])
            rows.append({"prompt": f"after {number} comes", "chosen": f" {number + 1}", "rejected": f" {off}"})
    return rows


def _texts(rows: list[dict[str, str]]) -> list[str]:
    return [row.get("text", row.get("prompt", "") + row.get("completion", "")) for row in rows]


def tiny_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE trained on :func:`tiny_corpus`, which
    adds ``<|begin_of_text|>`` in front of a text, as Llama 3's does (any text encodes:
    bytes it did not see stay single-byte tokens), with :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCABULARY_SIZE, special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_texts(tiny_corpus()), trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                             special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=CHAT_TEMPLATE, **SPECIAL_TOKENS)


def tiny_llama_config(tokenizer: Any) -> Any:
    """``LlamaConfig`` of 2 decoder layers, width 64, 4 query and 2 key/value heads
    (grouped-query attention, as Llama 3), sized to ``tokenizer``."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def tiny_llama(tokenizer: Any, seed: int) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` of :func:`tiny_llama_config`, in fp32,
    drawn from ``seed`` alone (the global random state is left as it was)."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_llama_config(tokenizer)).float()


def write_tiny_lm(folder: Path, seed: int = 0) -> Path:
    """:func:`tiny_llama` of ``seed`` and its tokenizer as a Hugging Face folder
    (``save_pretrained``: config.json, model.safetensors, tokenizer files)."""
    tokenizer = tiny_tokenizer()
    tiny_llama(tokenizer, seed).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def write_corpus(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a JSONL file, one object a line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m skylift.recipes.tiny_lm", description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, help="where to write the generated corpus (JSONL)")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="also write the tiny Llama and its tokenizer to this folder")
    parser.add_argument("--chat", type=Path, default=None, metavar="PATH",
                        help="also write the generated conversations (JSONL of messages rows) here")
    parser.add_argument("--preferences", type=Path, default=None, metavar="PATH",
                        help="also write the generated preference pairs (JSONL of prompt/chosen/rejected rows) here")
    args = parser.parse_args(argv)
    print(write_corpus(args.corpus, tiny_corpus()))
    if args.chat is not None:
        print(write_corpus(args.chat, tiny_chats()))
    if args.preferences is not None:
        print(write_corpus(args.preferences, tiny_preferences()))
    if args.model is not None:
        print(write_tiny_lm(args.model))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Chat data for the causal LM: ``messages`` rows rendered by the tokenizer's own chat
template, the assistant turns' tokens the only targets, through packing and padding, the
loss per assistant token, the refusals, TRL's ``assistant_only_loss`` as the oracle, and
the shipped chat preset.

The tokenizer is the built-in tiny Llama's (its chat template is skylift's); nothing is
downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="needs the text extra (transformers)")

from skylift.data.chat import Conversation, read_conversation
from skylift.data.jsonl_text import (
    IGNORE_INDEX,
    DocumentSequences,
    PackedBlocks,
    causal_collate,
    encode_conversations,
    read_jsonl_documents,
)
from skylift.errors import SkyliftConfigError
from skylift.recipes.causal_lm import CausalLM
from skylift.recipes.tiny_lm import CHAT_TEMPLATE, tiny_chats, tiny_tokenizer, write_corpus, write_tiny_lm
from tests.checkpoint.runs import losses_by_step, run_here
from tests.recipes.tiny_lm import lm_config

UNIT_ROUNDOFF = 2.0**-24
"""fp32's unit roundoff u: one rounding's relative error is at most u."""

SYSTEM_AND_TWO_TURNS = [
    {"role": "system", "content": "answer with colours and numbers"},
    {"role": "user", "content": "colour of a lemon:"},
    {"role": "assistant", "content": "yellow"},
    {"role": "user", "content": "after 12 comes"},
    {"role": "assistant", "content": "13"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "14"},
]

LLAMA3_LAYOUT = (
    "{{- bos_token }}{% for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
"""Llama 3's layout, written here: header tokens around the role, the turn ended by
``<|eot_id|>``, which the generation block holds."""

WITHOUT_GENERATION_BLOCKS = CHAT_TEMPLATE.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _conversation(messages, where="recipe.train_path: chats.jsonl:1") -> Conversation:
    return read_conversation(messages, where)


def _runs(ids: list[int], targets: list[bool], tokenizer) -> list[str]:
    """The labelled tokens, decoded, one string per run of consecutive labelled tokens."""
    runs: list[list[int]] = []
    for index, (token, target) in enumerate(zip(ids, targets, strict=True)):
        if target:
            if index == 0 or not targets[index - 1]:
                runs.append([])
            runs[-1].append(token)
    return [tokenizer.decode(run) for run in runs]


def test_labels_are_exactly_the_assistant_turns(tokenizer):
    """A system message and three exchanges: the labelled tokens decode to each assistant
    content followed by the end-of-turn token, which the tiny template puts inside its
    generation block (so the model learns to stop); the header ``assistant\\n`` before it
    is a prompt. The token ids are the rendered text's, nothing added around them."""
    [document] = encode_conversations([_conversation(SYSTEM_AND_TWO_TURNS)], tokenizer, "recipe.train_path")
    rendered = tokenizer.apply_chat_template(SYSTEM_AND_TWO_TURNS, tokenize=False)
    assert tokenizer.decode(document.ids) == rendered
    assert document.ids[0] == tokenizer.bos_token_id and document.ids[-1] == tokenizer.eos_token_id
    eos = tokenizer.eos_token
    assert _runs(document.ids, document.targets, tokenizer) == [f"yellow{eos}", f"13{eos}", f"14{eos}"]
    # Everything else is the prompt: the text with the assistant turns cut out.
    prompt = tokenizer.decode([token for token, target in zip(document.ids, document.targets, strict=True)
                               if not target])  # fmt: skip
    assert prompt == rendered.replace(f"yellow{eos}", "").replace(f"13{eos}", "").replace(f"14{eos}", "")
    [everything] = encode_conversations([_conversation(SYSTEM_AND_TWO_TURNS)], tokenizer, "recipe.train_path",
                                        mask_prompt=False)  # fmt: skip
    assert everything.ids == document.ids and all(everything.targets)


def test_llama3_layout_labels_content_and_eot(tokenizer):
    """Llama 3's layout, with its header and end-of-turn tokens added to a copy of the
    tokenizer: ``<|eot_id|>`` is inside the generation block, so it is labelled; the header
    tokens are not."""
    llama3 = tiny_tokenizer()
    llama3.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
    llama3.chat_template = LLAMA3_LAYOUT
    [document] = encode_conversations([_conversation(SYSTEM_AND_TWO_TURNS)], llama3, "recipe.train_path")
    assert llama3.decode(document.ids) == llama3.apply_chat_template(SYSTEM_AND_TWO_TURNS, tokenize=False)
    assert _runs(document.ids, document.targets, llama3) == ["yellow<|eot_id|>", "13<|eot_id|>", "14<|eot_id|>"]


def test_a_template_without_generation_blocks_gives_the_same_labels_from_its_prefixes(tokenizer):
    """The tiny template with its generation blocks taken out: the turns found by rendering
    prefixes are the ones the blocks marked, token for token."""
    plain = tiny_tokenizer()
    plain.chat_template = WITHOUT_GENERATION_BLOCKS
    conversations = [_conversation(row["messages"]) for row in tiny_chats(40)] + [_conversation(SYSTEM_AND_TWO_TURNS)]
    marked = encode_conversations(conversations, tokenizer, "recipe.train_path")
    derived = encode_conversations(conversations, plain, "recipe.train_path")
    assert [(document.ids, document.targets) for document in derived] == \
        [(document.ids, document.targets) for document in marked]  # fmt: skip


def test_chat_documents_keep_their_masks_through_packing_and_padding(tokenizer):
    conversations = [_conversation(row["messages"]) for row in tiny_chats(30)]
    documents = encode_conversations(conversations, tokenizer, "recipe.train_path")
    stream = [token for document in documents for token in document.ids]
    targets = [flag for document in documents for flag in document.targets]
    blocks = PackedBlocks(documents, 32, field="recipe.train_path")
    used = len(blocks) * 32
    # Position t of the flattened blocks predicts stream token t + 1, exactly when it is an assistant token.
    expected = [token if flag else IGNORE_INDEX for token, flag in zip(stream[1 : used + 1], targets[1 : used + 1],
                                                                       strict=True)]  # fmt: skip
    assert blocks.labels.flatten().tolist() == expected
    sequences = DocumentSequences(documents, sequence_length=512)
    input_ids, attention_mask, labels = causal_collate(tokenizer.pad_token_id)([sequences[i] for i in range(4)])
    for row, document in enumerate(documents[:4]):
        length = len(document.ids) - 1
        assert input_ids[row, :length].tolist() == document.ids[:-1]
        assert labels[row, :length].tolist() == [token if flag else IGNORE_INDEX for token, flag in
                                                 zip(document.ids[1:], document.targets[1:], strict=True)]  # fmt: skip
        assert (labels[row, length:] == IGNORE_INDEX).all() and not attention_mask[row, length:].any()


def test_the_loss_is_the_mean_over_assistant_tokens(tmp_path):
    """The recipe's loss on one padded batch of chats against F.cross_entropy over the
    assistant tokens only (found from transformers' own assistant mask, not the recipe's
    labels), summed and divided by their number, on the same logits."""
    chats = tiny_chats(12)
    train = write_corpus(tmp_path / "chats.jsonl", chats)
    recipe = CausalLM(lm_config(tmp_path / "run", "builtin:tiny-llama", train, "recipe.packing=false",
                                "recipe.sequence_length=256", "precision=fp32", val=train))  # fmt: skip
    data = recipe.build_datasets()
    model = recipe.build_model(data).eval()
    batch = recipe.collate(train=True)([data.train[i] for i in range(8)])  # the file's order: val_path is given
    with torch.no_grad():
        loss = recipe.training_loss(model, batch)
        logits = model(input_ids=batch[0], attention_mask=batch[1]).logits
    per_token = []
    for row, chat in enumerate(chats[:8]):
        encoded = recipe.tokenizer.apply_chat_template(chat["messages"], return_dict=True,
                                                       return_assistant_tokens_mask=True)  # fmt: skip
        ids, assistant = encoded["input_ids"], encoded["assistant_masks"]
        assert batch[0][row, : len(ids) - 1].tolist() == ids[:-1]
        positions = [t for t in range(len(ids) - 1) if assistant[t + 1]]  # position t predicts token t + 1
        targets = torch.tensor([ids[t + 1] for t in positions])
        per_token.append(F.cross_entropy(logits[row, positions], targets, reduction="none"))
    losses = torch.cat(per_token)
    count = len(losses)
    assert int(recipe.loss_count(batch)) == count
    hand = float(losses.double().sum()) / count
    # The same fp32 per-token losses summed in another order: the recipe's fp32 sum of n
    # non-negative terms is within (n - 1)u of the exact one (Higham 2002, eq. 4.4), the
    # division one more rounding, and a per-token loss computed by another kernel launch at
    # most one rounding apart: rtol = (n - 1)u + u + u <= 2nu.
    assert float(loss) == pytest.approx(hand, rel=2 * count * UNIT_ROUNDOFF)
    assert count < (batch[2] != IGNORE_INDEX).numel() / 4, "most positions should be prompt or padding"


def test_a_tokenizer_without_chat_template_is_refused_with_the_fix(tmp_path):
    folder = write_tiny_lm(tmp_path / "model")
    for path in folder.glob("chat_template.*"):  # where save_pretrained put the template
        path.unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    train = write_corpus(tmp_path / "chats.jsonl", tiny_chats(20))
    with pytest.raises(SkyliftConfigError) as refused:
        CausalLM(lm_config(tmp_path / "run", str(folder), train)).build_datasets()
    [problem] = refused.value.problems
    assert "\n" not in problem and "recipe.train_path: chat rows" in problem and "has none" in problem
    assert "Give the tokenizer a chat_template" in str(refused.value.hint)
    assert "prompt/completion or text rows" in str(refused.value.hint)


@pytest.mark.parametrize(("lines", "message"), [
    (['{"text": "count from 1: 1 2"}', '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'],
     r"rows.jsonl:2: a chat \(\"messages\"\) row in a file whose first row \(line 1\) is a text or prompt/completion"),
    (['{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}', "",
      '{"prompt": "q", "completion": "a"}'],
     r"rows.jsonl:3: a text or prompt/completion row in a file whose first row \(line 1\) is a chat"),
    (['{"messages": [{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]}'],
     r"rows.jsonl:1: messages\[1\].role is 'robot': it must be one of system, user, assistant"),
    (['{"messages": [{"role": "user"}, {"role": "assistant", "content": "a"}]}'],
     r"rows.jsonl:1: messages\[0\].content must be a string, not missing"),
    (['{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ["a"]}]}'],
     r"rows.jsonl:1: messages\[1\].content must be a string, not list"),
    (['{"messages": [{"role": "user", "content": "q", "tool_calls": []}]}'],
     r"rows.jsonl:1: messages\[0\] holds \['tool_calls'\]"),
    (['{"messages": [{"role": "user", "content": "q"}]}'], r"rows.jsonl:1: \"messages\" has no assistant message"),
    (['{"messages": []}'], r"rows.jsonl:1: \"messages\" must be a non-empty list"),
    (['{"messages": [{"role": "user", "content": "q"}], "text": "t"}'], r"rows.jsonl:1: a row holds \"messages\""),
])  # fmt: skip
def test_bad_chat_rows_name_the_line_and_field(tmp_path, lines, message):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SkyliftConfigError, match=message) as refused:
        read_jsonl_documents(path, "recipe.train_path")
    assert len(refused.value.problems) == 1 and "\n" not in refused.value.problems[0]


def test_templates_that_cannot_place_the_turns_are_refused_naming_the_row(tokenizer):
    conversation = _conversation(SYSTEM_AND_TWO_TURNS, "recipe.train_path: chats.jsonl:7")
    # Renders the last message apart: a prefix of the conversation is not the start of the whole.
    last_apart = tiny_tokenizer()
    last_apart.chat_template = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] + '\\n' + "
                                "m['content'] + eos_token }}{% endfor %}")  # fmt: skip
    with pytest.raises(SkyliftConfigError, match=r"chats.jsonl:7: the chat template has no \{% generation %\} "
                                                 r"blocks, and it renders the conversation up to messages\[2\]"):
        encode_conversations([conversation], last_apart, "recipe.train_path")
    raising = tiny_tokenizer()
    raising.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(SkyliftConfigError, match="chats.jsonl:7: the tokenizer's chat template fails on this row: "
                                                 ".*roles must alternate user/assistant"):  # fmt: skip
        encode_conversations([conversation], raising, "recipe.train_path")
    empty_block = tiny_tokenizer()
    empty_block.chat_template = WITHOUT_GENERATION_BLOCKS + "{% generation %}{% endgeneration %}"
    with pytest.raises(SkyliftConfigError, match="chats.jsonl:7: the chat template marks no token of this row"):
        encode_conversations([conversation], empty_block, "recipe.train_path")


def test_labels_equal_trls_assistant_only_loss(tokenizer, tmp_path, monkeypatch):
    """TRL's SFTTrainer, ``assistant_only_loss=True``, on an in-memory dataset of the same
    conversations and the same tokenizer: its tokenized rows are skylift's documents, its
    labelled positions (unshifted, Hugging Face's convention) skylift's targets. (5.5 s here,
    most of it importing TRL.)"""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    # SFTTrainer's constructor pings the Hub's telemetry from a thread unless offline mode,
    # which huggingface_hub reads once at import (already done here), or CI is set.
    monkeypatch.setenv("CI", "1")
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from skylift.recipes.tiny_lm import tiny_llama

    rows = [*tiny_chats(24), {"messages": SYSTEM_AND_TWO_TURNS}]
    args = trl.SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], use_cpu=True,
                         max_length=None, packing=False, disable_tqdm=True)  # fmt: skip
    trainer = trl.SFTTrainer(model=tiny_llama(tokenizer, 0), args=args, processing_class=tokenizer,
                             train_dataset=datasets.Dataset.from_list(rows))  # fmt: skip
    theirs = [(row["input_ids"], [label != IGNORE_INDEX for label in row["labels"]]) for row in trainer.train_dataset]
    ours = encode_conversations([_conversation(row["messages"]) for row in rows], tokenizer, "recipe.train_path")
    assert [(document.ids, document.targets) for document in ours] == theirs


def test_shipped_chat_corpus_is_the_generated_one():
    lines = Path("examples/data/tiny-chat.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == tiny_chats()


@pytest.mark.slow  # an end-to-end run: 7-15 s on the shared 2-core machine
def test_shipped_chat_preset_learns_in_one_epoch(tmp_path):
    """examples/sft-lora-chat-cpu.yaml as shipped, one epoch (38 steps of documents packed
    apart; 36 packed across them) in this process: the loss over the assistant tokens
    falls from chance (ln 460 = 6.1) well down (measured: 6.13 -> 1.44)."""
    pytest.importorskip("peft", reason="needs the llm extra (peft)")
    run_dir = tmp_path / "run"
    result = run_here("run", "examples/sft-lora-chat-cpu.yaml", "--json", "--no-doctor", "--set",
                      f"run_dir={run_dir}", "--set", "schedule.epochs=1", "--set", "checkpoint.every_minutes=null",
                      "--set", "monitor.report=false", "--set", "monitor.tensorboard=false", "--set",
                      "monitor.progress_bar=false")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    losses = losses_by_step(run_dir)
    assert len(losses) == 38 and losses[1] > 5.5 and max(losses[step] for step in (36, 37, 38)) < 2.5

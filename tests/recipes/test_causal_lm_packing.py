"""Packing without crossing documents: several documents in one sequence, each attending
only to itself (per-document position ids, transformers' block-diagonal causal mask). Each
document's logits and loss inside a packed batch equal its own run alone, on the tiny
Llama the recipe builds, under sdpa and eager; no label crosses a boundary; long
documents are split into pieces; the packing is deterministic; an attention that cannot
take the mask is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs the text extra (transformers)")

from skylift.data.jsonl_text import (
    IGNORE_INDEX,
    EncodedDocument,
    PackedBlocks,
    PackedDocuments,
    best_fit_decreasing,
    encode_documents,
)
from skylift.errors import SkyliftConfigError
from skylift.recipes.causal_lm import CausalLM, check_packed_attention, token_loss_sums
from skylift.recipes.tiny_lm import tiny_corpus, tiny_llama, tiny_tokenizer
from tests.recipes.tiny_lm import lm_config, write_model_folder, write_rows

UNIT_ROUNDOFF = 2.0**-24
"""fp32's unit roundoff u: one rounding is off by at most u relative."""


@pytest.fixture(autouse=True)
def one_thread():
    """One thread: this tiny model's operators are microseconds, and two threads on the
    shared 2-core machine wait on each other (the CPU preset's docs: 25x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _documents(tokenizer, rows) -> list[EncodedDocument]:
    def encode(texts, special):
        return tokenizer(texts, add_special_tokens=special)["input_ids"] if texts else []

    return encode_documents(rows, encode, tokenizer.eos_token_id)


def _model_folder(tmp_path: Path, attention: str) -> Path:
    """The tiny Llama as a folder whose config.json names ``attention``, as one saved from
    a model loaded with ``attn_implementation=...`` does."""
    folder = write_model_folder(tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["attn_implementation"] = attention
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _tolerance(model, logits: torch.Tensor) -> float:
    """How far two fp32 computations of the same logits may be apart when only the order
    of their sums differs (another kernel, masked vs ``is_causal`` attention, other matrix
    shapes). A sum of n terms in fp32 is off by at most (n - 1)u times the sum of the
    terms' magnitudes; the longest sum here is the MLP's down projection
    (intermediate_size terms), the others (hidden size, the attention over at most
    sequence_length keys) are shorter. Each of the 2 layers adds such errors to the
    residual stream and the head sums over hidden_size more: bound the lot by
    4 x layers x n x u x the largest logit (the magnitudes stay of the logits' order in
    this tiny model). Documents attending to one another move logits by ~1e-1, 10^3 and
    more times this."""
    config = model.config
    reduction_length = max(config.intermediate_size, config.hidden_size)
    return 4 * config.num_hidden_layers * reduction_length * UNIT_ROUNDOFF * float(logits.abs().max())


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_each_packed_document_equals_its_run_alone(tmp_path, attention):
    train = write_rows(tmp_path / "train.jsonl", tiny_corpus(60))
    recipe = CausalLM(lm_config(tmp_path / "run", "builtin:tiny-llama", train, "recipe.sequence_length=48"))
    data = recipe.build_datasets()
    model = recipe.build_model(data).eval()
    assert model.config._attn_implementation == "sdpa"  # transformers' default where torch has it
    model.set_attn_implementation(attention)
    assert isinstance(data.train, PackedDocuments)
    indices = list(range(6))
    batch = recipe.collate(train=True)([data.train[index] for index in indices])
    assert set(batch) == {"input_ids", "position_ids", "labels"}
    with torch.no_grad():
        packed = recipe.logits(model, batch)
        packed_sum, packed_count = recipe.eval_sums(model, batch).values()
        alone_sum, alone_count, checked = 0.0, 0, 0
        for row, index in enumerate(indices):
            start = 0
            for length in data.train.document_lengths[index]:
                inputs = batch["input_ids"][row, start : start + length]
                labels = batch["labels"][row, start : start + length]
                assert batch["position_ids"][row, start : start + length].tolist() == list(range(length))
                logits = model(input_ids=inputs[None]).logits[0]  # the document alone, unpacked
                document = packed[row, start : start + length]
                tolerance = _tolerance(model, logits)
                assert (document - logits).abs().max() <= tolerance, f"row {row}, document at {start}"
                loss_sum, count = token_loss_sums(logits[None], labels[None])
                packed_loss_sum, _ = token_loss_sums(document[None], labels[None])
                # Cross-entropy moves by at most 2 x the largest logit change per token; the
                # sum of `count` token losses adds (count - 1)u of rounding.
                bound = count * (2 * tolerance) + 2 * int(count) * UNIT_ROUNDOFF * float(loss_sum)
                assert abs(float(packed_loss_sum) - float(loss_sum)) <= bound
                alone_sum, alone_count = alone_sum + float(loss_sum), alone_count + int(count)
                start += length
                checked += 1
    assert checked > 2 * len(indices), "the rows should each hold several documents"
    # The recipe's loss per labelled token over the packed batch is the documents' alone.
    assert int(packed_count) == alone_count
    assert float(packed_sum) / float(packed_count) == pytest.approx(alone_sum / alone_count, rel=1e-5)


def test_attention_across_documents_is_what_the_check_catches(tokenizer):
    """The negative control: the same documents as one stream (packing_across_documents)
    give other logits than alone, by far more than the tolerance above."""
    documents = _documents(tokenizer, tiny_corpus(20))
    model = tiny_llama(tokenizer, 0).eval()
    blocks = PackedBlocks(documents, 48, field="recipe.train_path")
    second = len(documents[0].ids)  # the second document starts here in block 0
    length = len(documents[1].ids) - 1
    with torch.no_grad():
        streamed = model(input_ids=blocks.input_ids[:1]).logits[0, second : second + length]
        alone = model(input_ids=torch.tensor([documents[1].ids[:-1]])).logits[0]
    assert (streamed - alone).abs().max() > 1000 * _tolerance(model, alone)


def test_no_label_crosses_a_boundary_and_positions_restart(tokenizer):
    documents = _documents(tokenizer, tiny_corpus(40))
    packed = PackedDocuments(documents, 32, field="recipe.train_path")
    seen: list[tuple[list[int], list[int]]] = []
    for (inputs, labels, positions), lengths in zip(packed, packed.document_lengths, strict=True):
        assert sum(lengths) == len(inputs) == len(labels) == len(positions) <= 32
        start = 0
        for length in lengths:
            assert positions[start : start + length].tolist() == list(range(length))
            seen.append((inputs[start : start + length].tolist(), labels[start : start + length].tolist()))
            start += length
    # Each document is its inputs ids[:-1] and labels ids[1:] (masked where no target): its
    # last position predicts its own end-of-sequence token, never the next document's first.
    expected = [(document.ids[:-1], [token if flag else IGNORE_INDEX for token, flag in
                                     zip(document.ids[1:], document.targets[1:], strict=True)])
                for document in documents]  # fmt: skip
    assert sorted(seen) == sorted(expected)
    assert all(labels[-1] == tokenizer.eos_token_id for _, labels in seen)
    assert packed.split_documents == 0


def test_long_documents_are_split_into_pieces_each_its_own_document():
    ids = list(range(100, 123))  # 23 tokens: 22 predictions
    packed = PackedDocuments([EncodedDocument(ids, [True] * len(ids))], 8, field="recipe.train_path")
    assert packed.split_documents == 1
    pieces = sorted((inputs.tolist(), labels.tolist(), positions.tolist()) for inputs, labels, positions in packed)
    # Pieces of 8, 8 and 6 positions, one token of overlap: every token but the first predicted once.
    assert pieces == [(ids[0:8], ids[1:9], list(range(8))), (ids[8:16], ids[9:17], list(range(8))),
                      (ids[16:22], ids[17:23], list(range(6)))]  # fmt: skip


def test_packing_is_deterministic_and_fills_by_best_fit():
    # 7 opens a bin, 5 and 4 open two more; 3 fills the room-3 bin, 2 the room-4 one, 1 the room-1 one.
    assert best_fit_decreasing([5, 3, 7, 2, 4, 1], 8) == [[2, 5], [0, 1], [3, 4]]
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 64, (500,), generator=generator).tolist()
    bins = best_fit_decreasing(lengths, 64)
    assert bins == best_fit_decreasing(list(lengths), 64)
    assert sorted(index for members in bins for index in members) == list(range(500))
    assert all(sum(lengths[index] for index in members) <= 64 for members in bins)
    # Best-fit decreasing uses at most 11/9 OPT + 6/9 bins (Johnson 1973), and OPT is at
    # least the total over the capacity; here it is within 2% of that floor.
    floor = -(-sum(lengths) // 64)
    assert len(bins) <= 11 / 9 * floor + 6 / 9 and len(bins) <= 1.02 * floor


def test_an_attention_that_cannot_take_the_mask_is_refused(tmp_path, tokenizer):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # A custom kernel, registered as transformers lets one: it gets no mask from
    # create_causal_mask, so packed documents would see each other.
    AttentionInterface.register("skylift_test_kernel", sdpa_attention_forward)
    train = write_rows(tmp_path / "train.jsonl", tiny_corpus(30))
    folder = _model_folder(tmp_path, "skylift_test_kernel")
    recipe = CausalLM(lm_config(tmp_path / "run", str(folder), train))
    with pytest.raises(SkyliftConfigError, match="recipe.packing: LlamaForCausalLM cannot keep packed documents "
                                                 "apart: its attention implementation is 'skylift_test_kernel'") as caught:
        recipe.build_model()
    assert "Set recipe.packing: false" in caught.value.hint
    # Unpacked, or packed across documents on purpose, the same model builds.
    for setting in ("recipe.packing=false", "recipe.packing_across_documents=true"):
        CausalLM(lm_config(tmp_path / "run", str(folder), train, setting)).build_model()
    with pytest.raises(SkyliftConfigError, match="flash_attention_2"):
        model = tiny_llama(tokenizer, 0)
        model.config._attn_implementation_internal = "flash_attention_2"
        check_packed_attention(model)


def test_packing_across_documents_is_explicit_and_keeps_the_stream_blocks(tmp_path):
    train = write_rows(tmp_path / "train.jsonl", tiny_corpus(60))
    recipe = CausalLM(lm_config(tmp_path / "run", "builtin:tiny-llama", train, "recipe.packing_across_documents=true",
                                "recipe.sequence_length=16"))
    data = recipe.build_datasets()
    assert isinstance(data.train, PackedBlocks)
    input_ids, attention_mask, labels = recipe.collate(train=True)([data.train[0], data.train[1]])
    assert attention_mask.all()
    with pytest.raises(SkyliftConfigError, match="recipe.packing_across_documents: true needs recipe.packing: true"):
        CausalLM(lm_config(tmp_path / "run", "builtin:tiny-llama", train, "recipe.packing=false",
                           "recipe.packing_across_documents=true"))  # fmt: skip

"""Causal-LM fine-tuning: JSONL documents, prompt masks, packing, the loss per labelled
token across micro-batches and ranks, evaluation sums, and the CPU preset end to end.

The model is a tiny Llama made from its config class and written by ``save_pretrained``
here, its tokenizer a byte-level BPE trained here: nothing is downloaded."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs the text extra (transformers)")

from safetensors.torch import load_file

from skylift.data.jsonl_text import (
    IGNORE_INDEX,
    DocumentSequences,
    PackedBlocks,
    causal_collate,
    encode_documents,
    read_jsonl_documents,
)
from skylift.data.sampler import GlobalBatchSampler
from skylift.errors import SkyliftConfigError
from skylift.recipes.causal_lm import CausalLM, token_loss_sums
from skylift.recipes.tiny_lm import tiny_corpus, tiny_llama, tiny_tokenizer
from tests.checkpoint.runs import state_kept
from tests.recipes.tiny_lm import (
    PRESET,
    SGD_STEP,
    lm_config,
    run_args,
    train_losses,
    uneven_rows,
    write_model_folder,
    write_rows,
)

UNIT_ROUNDOFF = 2.0**-24
"""fp32's unit roundoff u: one rounding's relative error is at most u."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny Llama folder and JSONL sets of uneven prompt lengths, written once."""
    root = tmp_path_factory.mktemp("causal-lm")
    return {
        "root": root,
        "model": write_model_folder(root / "model"),
        "train": write_rows(root / "train.jsonl", uneven_rows()),
        "val": write_rows(root / "val.jsonl", uneven_rows(8)),
    }


@pytest.fixture(scope="module")
def tokenizer(files):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(files["model"]))


def _encode(tokenizer):
    return lambda texts, special: tokenizer(texts, add_special_tokens=special)["input_ids"]


def test_rows_need_text_or_prompt_and_completion(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "fine"}\n\n{"prompt": "no completion"}\n')
    with pytest.raises(SkyliftConfigError, match=r"rows.jsonl:3: a row needs \"text\", or \"prompt\" and"):
        read_jsonl_documents(path, "recipe.train_path")
    path.write_text('{"prompt": "q", "completion": 7}\n')
    with pytest.raises(SkyliftConfigError, match=r":1: \"completion\" must be a string, not int"):
        read_jsonl_documents(path, "recipe.train_path")
    with pytest.raises(SkyliftConfigError, match="recipe.val_path: .*missing.jsonl is not a file"):
        read_jsonl_documents(tmp_path / "missing.jsonl", "recipe.val_path")


def test_prompt_tokens_carry_no_loss_and_packing_predicts_every_token_once(tokenizer):
    rows = uneven_rows()
    documents = encode_documents(rows, _encode(tokenizer), tokenizer.eos_token_id)
    for row, document in zip(rows, documents, strict=True):
        assert document.ids[-1] == tokenizer.eos_token_id
        if "prompt" in row:
            prompt = tokenizer(row["prompt"])["input_ids"]
            assert document.ids[: len(prompt)] == prompt and not any(document.targets[: len(prompt)])
            assert all(document.targets[len(prompt) :])
        else:
            assert all(document.targets)
    stream = [token for document in documents for token in document.ids]
    targets = [flag for document in documents for flag in document.targets]
    blocks = PackedBlocks(documents, 16, field="recipe.train_path")
    used = len(blocks) * 16
    assert blocks.dropped_tokens == len(stream) - used - 1 < 16
    assert blocks.input_ids.flatten().tolist() == stream[:used]
    # Position t of the flattened blocks predicts stream token t + 1, exactly when that token is a target.
    expected = [token if flag else IGNORE_INDEX for token, flag in zip(stream[1 : used + 1], targets[1 : used + 1],
                                                                       strict=True)]  # fmt: skip
    assert blocks.labels.flatten().tolist() == expected
    counts = (blocks.labels != IGNORE_INDEX).sum(dim=1)
    assert counts.min() < counts.max() / 4, "the blocks' labelled-token counts should differ a lot"


def test_unmasked_prompts_and_single_documents_padded(tokenizer):
    rows = [{"prompt": "colour of a lemon:", "completion": " yellow"}, {"text": "count from 1: 1 2 3 4 5 6 7 8"}]
    unmasked = encode_documents(rows, _encode(tokenizer), tokenizer.eos_token_id, mask_prompt=False)
    assert all(all(document.targets) for document in unmasked)
    documents = encode_documents(rows, _encode(tokenizer), tokenizer.eos_token_id)
    sequences = DocumentSequences(documents, sequence_length=6)
    assert sequences.truncated == 2 and sequences.lengths == [6, 6]
    short = DocumentSequences(documents[:1], sequence_length=64)
    assert short.lengths == [len(documents[0].ids) - 1]
    input_ids, attention_mask, labels = causal_collate(pad_id=0)([short[0], sequences[1]])
    assert input_ids.shape == labels.shape == attention_mask.shape == (2, short.lengths[0])
    pad = attention_mask == 0
    assert pad.sum() == short.lengths[0] - 6 and (labels[pad] == IGNORE_INDEX).all() and (input_ids[pad] == 0).all()
    assert torch.equal(labels[0], short[0][1])


def test_builtin_tiny_llama_is_the_same_every_time():
    first, second = tiny_tokenizer(), tiny_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    weights = [tiny_llama(first, seed).state_dict() for seed in (0, 0, 1)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not torch.equal(weights[0]["model.embed_tokens.weight"], weights[2]["model.embed_tokens.weight"])
    assert first.decode(first("after 12 comes 13")["input_ids"][1:]) == "after 12 comes 13"


def test_shipped_corpus_is_the_generated_one():
    lines = Path("examples/data/tiny-lm.jsonl").read_text(encoding="utf-8").splitlines()
    shipped = [json.loads(line) for line in lines]
    assert shipped == tiny_corpus()


def test_eval_sums_give_the_loss_and_perplexity_per_labelled_token(files, tmp_path):
    recipe = CausalLM(lm_config(tmp_path / "run", str(files["model"]), files["train"], "recipe.packing=false",
                                "recipe.sequence_length=32"))  # fmt: skip
    data = recipe.build_datasets()
    model = recipe.build_model(data).eval()
    collate = recipe.collate(train=False)
    batches = [collate([data.train[i] for i in range(5)]), collate([data.train[i] for i in range(5, 12)])]
    with torch.no_grad():
        sums = [recipe.eval_sums(model, batch) for batch in batches]
        totals = {key: sum(float(part[key]) for part in sums) for key in sums[0]}
        metrics = recipe.summarize(totals)
        everything = collate([data.train[i] for i in range(12)])
        logits = model(input_ids=everything[0], attention_mask=everything[1]).logits
        labels = everything[2]
        per_token = torch.nn.functional.cross_entropy(logits[labels != IGNORE_INDEX], labels[labels != IGNORE_INDEX])
    assert totals["count"] == int((labels != IGNORE_INDEX).sum())
    # The same per-token losses (rows are computed independently) summed in another order:
    # each fp32 sum of n non-negative terms is within (n - 1)u of the exact one.
    assert metrics["loss"] == pytest.approx(float(per_token), rel=2 * totals["count"] * UNIT_ROUNDOFF)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]), rel=1e-12)
    assert recipe.summarize({"loss_sum": 1e6, "count": 1.0})["perplexity"] == math.inf


@pytest.fixture(scope="module")
def one_step(files):
    """One plain SGD step over the whole training set as one global batch of 32 packed
    blocks, in 2 accumulated micro-batches, by the real Trainer in this process."""
    from skylift.train.trainer import Trainer

    run_dir = files["root"] / "one-step"
    config = _one_step_config(files, run_dir, "accumulation.steps=2")
    Trainer(config).fit()
    return config, run_dir


# The stream blocks (recipe.packing_across_documents) give every row the same shape, so the
# reference below runs them as one tensor; the step's normalisation is the same either way.
def _one_step_config(files, run_dir, *overrides: str):
    return lm_config(run_dir, str(files["model"]), files["train"], *SGD_STEP, "recipe.sequence_length=16",
                     "recipe.packing_across_documents=true",
                     "data.global_batch_size=32", "schedule.max_steps=1", "schedule.epochs=1",
                     "checkpoint.enabled=false", "monitor.log_every_steps=1", *overrides, val=files["val"])  # fmt: skip


def _reference(files, config, world_size: int):
    """The step computed in one process over the whole global batch: the sum of every
    labelled token's loss divided by their number, and its gradient; and the same with
    the wrong normalisation (the mean of the micro-batches' own means), to tell them apart."""
    from transformers import AutoModelForCausalLM

    recipe = CausalLM(config)
    blocks = recipe.build_datasets().train
    assert len(blocks) == config.data.global_batch_size, "the test wants the whole set in one step"
    model = AutoModelForCausalLM.from_pretrained(str(files["model"]), dtype=torch.float32)
    logits = model(input_ids=blocks.input_ids).logits
    loss_sum, count = token_loss_sums(logits, blocks.labels)
    (loss_sum / count).backward(retain_graph=True)
    right = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    micro_batches = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(len(blocks), config.data.global_batch_size, config.accumulation.steps,
                                     rank=rank, world_size=world_size, seed=config.seed)  # fmt: skip
        micro_batches += list(sampler)
    means = [token_loss_sums(logits[index], blocks.labels[index]) for index in micro_batches]
    (sum(part_sum / part_count.clamp(min=1) for part_sum, part_count in means) / len(means)).backward()
    wrong = {name: p.grad.clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        micro_logits = torch.cat([model(input_ids=blocks.input_ids[index]).logits for index in micro_batches])
    order = torch.tensor([i for index in micro_batches for i in index])
    rows_alike = torch.equal(micro_logits, logits[order].detach())
    return float(loss_sum.detach() / count), int(count), right, wrong, rows_alike


def _check_step(files, config, run_dir, world_size: int) -> None:
    loss, count, right, wrong, rows_alike = _reference(files, config, world_size)
    # The micro-batches' forwards give the global batch's logits bit for bit (rows are
    # computed independently), so the run and the reference add up the same per-token
    # losses, in another order: micro-batch sums, the weights n_i*A*W/N, the accumulation
    # mean, the mean over ranks. Each of the two sums of N non-negative terms is within
    # (N - 1)u of the exact one (Higham, Accuracy and Stability, 2002, eq. 4.4), plus at
    # most 4 roundings of the weights and means: rtol = 2(N - 1)u + 4u.
    assert rows_alike
    assert train_losses(run_dir)[1] == pytest.approx(loss, rel=(2 * (count - 1) + 4) * UNIT_ROUNDOFF)
    # The weights moved by exactly minus the gradient (SGD, lr 1). A gradient entry sums
    # per-token terms of both signs, so its rounding has no a-priori bound of that kind;
    # what it must show is the normalisation: rounding leaves it within ~1e-7 of the
    # per-token reference (measured), while the mean of micro-batch means is 10-100%
    # away. The run must be 1000x closer to the right one than the wrong one is.
    start, end = load_file(files["model"] / "model.safetensors"), load_file(run_dir / "model.safetensors")
    moved = {name: start[name] - end[name] for name in right}
    distance = _norm({name: moved[name] - right[name] for name in right})
    wrong_distance = _norm({name: wrong[name] - right[name] for name in right})
    assert wrong_distance > 0.1 * _norm(right)
    assert distance < 1e-3 * wrong_distance


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(value.double().pow(2).sum()) for value in tensors.values()))


def test_step_loss_is_per_labelled_token_across_accumulation(files, one_step):
    config, run_dir = one_step
    _check_step(files, config, run_dir, world_size=1)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_step_loss_is_per_labelled_token_across_ranks(files, cli):
    """2 processes over gloo, 2 micro-batches each: the labelled-token counts are summed
    across ranks by one all-reduce, and the step equals the one-process reference."""
    run_dir = files["root"] / "two-ranks"
    config = _one_step_config(files, run_dir, "accumulation.steps=2")
    args = run_args(run_dir, *SGD_STEP, f"recipe.model_path={files['model']}",
                    f"recipe.train_path={files['train']}", f"recipe.val_path={files['val']}",
                    "recipe.sequence_length=16", "recipe.packing_across_documents=true",
                    "data.global_batch_size=32", "schedule.max_steps=1",
                    "schedule.epochs=1", "checkpoint.enabled=false", "monitor.log_every_steps=1",
                    "accumulation.steps=2")  # fmt: skip
    result = cli(*args, "--nproc", "2", env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    _check_step(files, config, run_dir, world_size=2)


def test_refusals_name_the_field(cli_here, files):
    result = cli_here("check", PRESET, "--set", "data.batching=token_budget")
    assert result.returncode == 2 and "recipe.packing" in result.stderr
    result = cli_here("check", PRESET, "--set", "recipe.packing=false", "--set", "data.batching=token_budget",
                      "--set", "data.max_tokens=1024", "--set", "recipe.sequence_length=2048")
    assert result.returncode == 2 and "sequence_length (2048) exceeds data.max_tokens (1024)" in result.stderr
    result = cli_here("check", PRESET, "--set", "data.url=s3://bucket/shards")
    assert result.returncode == 2 and "causal_lm reads JSONL files" in result.stderr
    result = cli_here("check", PRESET, "--set", "recipe.block_size=64")
    assert result.returncode == 2 and "recipe.block_size" in result.stderr
    with pytest.raises(SkyliftConfigError, match="recipe.model_path: .* holds no config.json"):
        CausalLM(lm_config(files["root"] / "run", str(files["root"]), files["train"]))


def test_cpu_preset_trains_and_reports_perplexity(cli_here, tmp_path):
    """The preset as shipped (the built-in tiny Llama, the generated corpus), one epoch of
    ``skylift run``: the loss falls from chance and evaluation reports perplexity. In this
    process, on one thread (state_kept): what the run trains and prints is under test, not a
    process start (~5 s of imports; the two-rank test above starts real processes)."""
    run_dir = tmp_path / "run"
    with state_kept():
        result = cli_here(*run_args(run_dir, "schedule.epochs=1", "checkpoint.every_minutes=null"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout[result.stdout.index("{") :])
    losses = train_losses(run_dir)
    vocabulary = len(tiny_tokenizer())
    # A fresh model predicts about uniformly: the first loss is near ln(vocabulary). The
    # counting runs and lookups are learnable: one epoch (22 steps of 16 packed sequences;
    # 24 when packing ran across documents) takes the validation loss below
    # 0.6 x ln(vocabulary) (measured: 5.8 -> 1.9, a third of it).
    assert losses[1] == pytest.approx(math.log(vocabulary), rel=0.1)
    evaluation = summary["eval_metrics"]
    assert evaluation["loss"] < 0.6 * math.log(vocabulary)
    assert evaluation["perplexity"] == pytest.approx(math.exp(evaluation["loss"]), rel=1e-9)
    assert summary["steps"] == len(losses) == 22


def test_token_budget_batches_whole_documents(files, tmp_path):
    """Unpacked documents under a token budget: micro-batches of varying size, padded to
    their longest; the labelled tokens still set each micro-batch's weight."""
    from skylift.train.trainer import Trainer

    config = lm_config(tmp_path / "run", str(files["model"]), files["train"], "recipe.packing=false",
                       "recipe.sequence_length=64", "data.batching=token_budget", "data.max_tokens=256",
                       "schedule.max_steps=3", "schedule.warmup_steps=0", "schedule.epochs=1", "checkpoint.enabled=false",
                       "monitor.log_every_steps=1", "precision=fp32", val=files["val"])  # fmt: skip
    summary = Trainer(config).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    epoch = next(record for record in records if record["kind"] == "epoch")
    assert epoch["padded_tokens"] > epoch["real_tokens"] > 0
    assert summary.steps == 3 and math.isfinite(summary.eval_metrics["perplexity"])

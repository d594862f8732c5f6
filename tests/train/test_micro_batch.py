"""``data.micro_batch_size``: a number, and ``auto`` found by real trials under a memory cap."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from skylift.config import load_config
from skylift.data.images import EncodedBatch
from skylift.errors import SkyliftConfigError
from skylift.train.micro_batch import _largest_fitting, slice_batch
from tests.checkpoint.runs import state_kept, train_environment

QUICKSTART = "examples/quickstart.yaml"
# 96 px synthetic images through the small CNN: each halving of the micro-batch frees
# hundreds of MiB of activations, far above the tens of MiB the resident set varies by. The
# whole batch's trial measured 1,320 MiB here (1,911 MiB at 128 px: the activations grow with
# the pixels, so ~760 MiB of activations on ~560 MiB of process), and 64 -> 32 frees ~380 MiB.
WORKLOAD = ["--set", "recipe.dataset=synthetic_images", "--set", "recipe.image_size=96", "--set",
            "recipe.num_samples=320", "--set", "schedule.max_steps=2", "--set", "checkpoint.enabled=false",
            "--set", "schedule.warmup_steps=1", "--set", "monitor.log_every_steps=1",
            "--set", "monitor.report=false", "--set", "monitor.tensorboard=false"]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(cli, run_dir, *extra: str, nproc: int = 1) -> list[dict]:
    # --no-doctor: the doctor's start-up checks (a memory trace of the model) run before the
    # trainer, which resets the peak resident set before its trials; they only cost time here.
    args = ["run", QUICKSTART, "--json", "--no-doctor", "--set", f"run_dir={run_dir}", *WORKLOAD, *extra]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    result = cli(*args, env=train_environment(nproc))  # one thread a process, as every run compared bitwise
    assert result.returncode == 0, result.stderr[-3000:]
    return _records(run_dir)


def _start(records: list[dict]) -> dict:
    return next(record for record in records if record["kind"] == "run_start")


@pytest.mark.slow
def test_auto_under_a_cap_takes_the_largest_fitting_divisor_and_trains_as_that_size(cli, cli_here, tmp_path):
    free = _start(_run(cli, tmp_path / "free", "--set", "data.micro_batch_size=auto", "--set", "schedule.max_steps=1"))
    assert free["micro_batch"]["chosen"] == 64 and free["accumulation_steps"] == 1
    (whole,) = free["micro_batch"]["trials"]  # the whole per-rank batch fit: one trial
    cap_bytes = whole["needed_bytes"] - 100 * 2**20

    records = _run(cli, tmp_path / "auto", "--set", "data.micro_batch_size=auto",
                   "--set", f"data.micro_batch_memory_gib={cap_bytes / 2**30}")
    choice = _start(records)["micro_batch"]
    chosen, trials = choice["chosen"], {t["micro_batch_size"]: t for t in choice["trials"]}
    assert choice["limit_bytes"] == pytest.approx(cap_bytes, abs=1)
    assert chosen < 64 and 64 % chosen == 0 and choice["accumulation_steps"] == 64 // chosen
    assert trials[chosen]["fits"] and trials[chosen]["needed_bytes"] <= choice["limit_bytes"]
    # The largest that fits: the next divisor up was measured and did not.
    above = min(size for size in (1, 2, 4, 8, 16, 32, 64) if size > chosen)
    assert not trials[above]["fits"] and trials[above]["needed_bytes"] > choice["limit_bytes"]
    assert _start(records)["micro_batch_size"] == chosen

    # The trials leave no trace: the same run configured with that size is identical. That
    # run has no trials and no cap, so it trains in this process (``state_kept``: one thread,
    # as the subprocess has): the two runs above stay processes, as their trials measure a
    # process's peak resident set, and the pytest process's would be another.
    with state_kept():
        fixed = _run(cli_here, tmp_path / "fixed", "--set", f"data.micro_batch_size={chosen}")
    assert _start(fixed)["accumulation_steps"] == choice["accumulation_steps"]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses and losses == [r["loss"] for r in fixed if r["kind"] == "train"]
    weights, expected = load_file(tmp_path / "auto" / "model.safetensors"), load_file(tmp_path / "fixed" / "model.safetensors")
    assert all(torch.equal(weights[name], expected[name]) for name in expected)


@pytest.mark.slow
def test_auto_over_two_processes_agrees_on_one_size(cli, tmp_path):
    records = _run(cli, tmp_path / "ddp", "--set", "data.micro_batch_size=auto", nproc=2)
    start = _start(records)
    assert start["world_size"] == 2 and start["micro_batch"]["chosen"] == 32  # 64 over 2 ranks, all fits
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["replicas_agree"] is True


def test_a_cap_below_one_sample_fails_naming_the_fields(capsys, tmp_path):
    # In this process: the refusal is the CLI's exit code and message, no process boundary is
    # under test, and 10 MiB is below any Python process's resident set, so the trial of 1
    # sample fails here as in a fresh `skylift run` (which costs a torch import more).
    from skylift.cli.main import main

    code = main(["run", QUICKSTART, "--set", f"run_dir={tmp_path}", *WORKLOAD,
                 "--set", "recipe.image_size=32", "--set", "data.micro_batch_size=auto",
                 "--set", "data.micro_batch_memory_gib=0.01"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    assert "even 1 sample per micro-batch needs" in stderr
    assert "data.micro_batch_memory_gib" in stderr


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.micro_batch_size=16", "accumulation.steps=2"], "keep one"),
    (["data.micro_batch_size=auto", "data.batching=token_budget", "recipe.name=text_classification",
      "recipe.model=minilm_l6", "recipe.dataset=synthetic_text"], "remove data.micro_batch_size"),
])
def test_conflicting_settings_are_refused(overrides, message):
    with pytest.raises(SkyliftConfigError, match=message):
        load_config(QUICKSTART, overrides)


def test_a_number_sets_accumulation_and_must_divide_the_rank_batch():
    config = load_config(QUICKSTART, ["data.micro_batch_size=16"])
    assert config.micro_batch_size(world_size=2) == 16
    assert config.with_micro_batch(16, world_size=2).accumulation.steps == 2
    with pytest.raises(ValueError, match=r"data.micro_batch_size \(16\) must divide the per-rank batch.* = 8"):
        config.micro_batch_size(world_size=8)


def test_a_hand_written_loop_is_told_to_set_a_number(tmp_path):
    from skylift.train.runtime import Runtime

    runtime = Runtime.from_config(QUICKSTART, overrides=["data.micro_batch_size=auto", f"run_dir={tmp_path}"])
    with pytest.raises(SkyliftConfigError, match="sets a number"):
        runtime.prepare(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("batch", [
    (torch.arange(8.0).reshape(8, 1), torch.arange(8)),
    [torch.zeros(8, 3), torch.arange(8)],
    {"input_ids": torch.zeros(8, 4), "labels": torch.arange(8)},
    EncodedBatch([bytes([i]) for i in range(8)], torch.arange(8)),  # the device-decode path's batch
])
def test_batches_are_cut_field_by_field(batch):
    def size(b):
        if isinstance(b, dict):
            return len(b["labels"])
        return len(b) if isinstance(b, EncodedBatch) else len(b[1])

    cut = slice_batch(batch, 3, size)
    assert size(cut) == 3
    labels = cut["labels"] if isinstance(cut, dict) else (cut.labels if isinstance(cut, EncodedBatch) else cut[1])
    assert labels.tolist() == [0, 1, 2]


@pytest.mark.parametrize("largest", [1, 2, 3, 4, 6, 12, None])
def test_bisection_finds_the_largest_fitting_divisor(largest):
    candidates = [1, 2, 3, 4, 6, 12]
    tried = []

    def fits(size):
        tried.append(size)
        return largest is not None and size <= largest

    assert _largest_fitting(candidates, fits) == largest
    assert tried[0] == 12 and len(tried) <= 4  # the whole batch first, then log2(5) + 1 bisection steps

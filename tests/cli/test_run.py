"""``skylift run`` end to end: training in real processes, the refusals before any training in this one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

QUICKSTART = "examples/quickstart.yaml"


def _summary(result) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout[result.stdout.index("{") :])


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_unknown_key_exits_2_and_suggests(cli_here):
    result = cli_here("run", QUICKSTART, "--set", "optim.learning_rate=0.1")
    assert result.returncode == 2
    assert "optim.learning_rate: unknown key" in result.stderr
    assert "Valid keys here:" in result.stderr and "lr" in result.stderr
    assert "skylift check" in result.stderr


def test_wrong_type_exits_2(cli_here):
    result = cli_here("run", QUICKSTART, "--set", "data.global_batch_size=lots")
    assert result.returncode == 2
    assert "data.global_batch_size" in result.stderr and "'lots'" in result.stderr


def test_bad_choice_exits_2_with_allowed_values(cli_here):
    result = cli_here("run", QUICKSTART, "--set", "optim.name=lion")
    assert result.returncode == 2
    assert "optim.name" in result.stderr and "'adamw'" in result.stderr and "'sgd'" in result.stderr


def test_bf16_on_a_device_without_it_exits_2(cli, tmp_path):
    # ATEN_CPU_CAPABILITY=avx2 really removes PyTorch's AVX512 bf16 kernels.
    result = cli("run", QUICKSTART, "--set", "precision=bf16", "--set", f"run_dir={tmp_path}",
                 env={"ATEN_CPU_CAPABILITY": "avx2"})
    assert result.returncode == 2
    assert "precision: bf16 was requested" in result.stderr
    assert "precision: fp32 or precision: auto" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_batch_that_does_not_split_over_processes_exits_2(cli_here):
    result = cli_here("run", QUICKSTART, "--nproc", "2", "--set", "data.global_batch_size=63")
    assert result.returncode == 2
    assert "data.global_batch_size (63)" in result.stderr


def test_dry_run_starts_nothing(cli_here, tmp_path):
    result = cli_here("run", QUICKSTART, "--dry-run", "--json", "--nproc", "2", "--set", f"run_dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["world_size"] == 2 and plan["micro_batch_size_per_rank"] == 32
    assert not (tmp_path / "run").exists()


def test_quickstart_learns_and_fills_the_run_folder(cli, tmp_path):
    run_dir = tmp_path / "run"
    summary = _summary(cli("run", QUICKSTART, "--json", "--set", "schedule.epochs=4", "--set", f"run_dir={run_dir}"))
    assert summary["eval_metrics"]["accuracy"] >= 0.9
    assert summary["steps"] == 4 * 22
    records = _metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 89))
    assert {"loss", "lr", "samples_per_s", "step_time_s", "epoch"} <= set(train[0])
    assert len([r for r in records if r["kind"] == "eval"]) == 4
    assert any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "config.yaml").read_text().startswith("run_dir:")
    assert (run_dir / "model.safetensors").stat().st_size > 0
    assert (run_dir / "report" / "index.html").stat().st_size > 0  # the HTML report, on by default
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 88


@pytest.mark.multiprocess
def test_two_process_ddp_equals_one_process_accumulating_the_same_micro_batches(cli, tmp_path):
    """DDP over 2 processes trains, bit for bit, the model of 1 process that accumulates the
    same 2 micro-batches per optimizer step; the 2 replicas agree bit for bit.

    Why this is exact: each global batch of 64 is cut into 2 contiguous halves, and rank r
    takes half r, the samples the single process takes as its r-th micro-step
    (``data/sampler.py``). Every half's forward and backward runs the same kernels on the
    same inputs with the same thread count (1 per process, set here, so the machine's core
    count plays no part), so the per-half gradients are equal; gloo's all-reduce of two
    addends is one commutative addition, and the halving (DDP's averaging, the
    accumulation's loss scaling) is exact in binary floating point. SmallCNN uses
    GroupNorm, whose output does not depend on the micro-batch.

    Why not 1 process on the whole batch of 64 at once: there the conv and linear backward
    reduce over 64 samples in another order than over 2 x 32, and oneDNN blocks that
    reduction per CPU (AVX2, AVX-512, AMX), so gradients differ by fp32 rounding (~1e-7
    relative). AdamW divides each gradient by its own running RMS, so where a gradient is
    near zero that rounding can flip the sign of its update, a difference of up to
    ~2 x lr per step: after 25 steps 1.3e-5 on one AMD EPYC and 0 on other CPUs. The
    arithmetic bounds that only by Adam's per-step update bound (Kingma & Ba, section
    2.1), which would hold for wrong gradients too, so the test makes the exact claim.
    """
    # No HTML report or TensorBoard files: neither is compared here, and the report's PNGs
    # cost each run more than its 25 steps do (test_quickstart_learns_... checks both).
    common = ["--json", "--set", "precision=fp32", "--set", "schedule.max_steps=25", "--set", "schedule.warmup_steps=5",
              "--set", "monitor.report=false", "--set", "monitor.tensorboard=false"]
    one_thread = {"OMP_NUM_THREADS": "1"}
    single = _summary(cli("run", QUICKSTART, *common, "--set", "accumulation.steps=2",
                          "--set", f"run_dir={tmp_path / 'one'}", env=one_thread))
    double = _summary(cli("run", QUICKSTART, "--nproc", "2", *common, "--set", f"run_dir={tmp_path / 'two'}",
                          env=one_thread))
    assert double["world_size"] == 2 and single["world_size"] == 1
    assert double["replicas_agree"] is True and double["replica_max_abs_diff"] == 0.0
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert one.keys() == two.keys()
    for name, tensor in one.items():
        assert torch.equal(two[name], tensor), name
    losses_one = [r["loss"] for r in _metrics(tmp_path / "one") if r["kind"] == "train"]
    losses_two = [r["loss"] for r in _metrics(tmp_path / "two") if r["kind"] == "train"]
    assert len(losses_one) == 25 and losses_two == losses_one

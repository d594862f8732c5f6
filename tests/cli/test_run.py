"""``skylift run`` end to end, in real processes."""

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


def test_unknown_key_exits_2_and_suggests(cli):
    result = cli("run", QUICKSTART, "--set", "optim.learning_rate=0.1")
    assert result.returncode == 2
    assert "optim.learning_rate: unknown key" in result.stderr
    assert "Valid keys here:" in result.stderr and "lr" in result.stderr
    assert "skylift check" in result.stderr


def test_wrong_type_exits_2(cli):
    result = cli("run", QUICKSTART, "--set", "data.global_batch_size=lots")
    assert result.returncode == 2
    assert "data.global_batch_size" in result.stderr and "'lots'" in result.stderr


def test_bad_choice_exits_2_with_allowed_values(cli):
    result = cli("run", QUICKSTART, "--set", "optim.name=lion")
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


def test_batch_that_does_not_split_over_processes_exits_2(cli):
    result = cli("run", QUICKSTART, "--nproc", "2", "--set", "data.global_batch_size=63")
    assert result.returncode == 2
    assert "data.global_batch_size (63)" in result.stderr


def test_dry_run_starts_nothing(cli, tmp_path):
    result = cli("run", QUICKSTART, "--dry-run", "--json", "--nproc", "2", "--set", f"run_dir={tmp_path / 'run'}")
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
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 88


@pytest.mark.multiprocess
def test_two_process_ddp_matches_one_process(cli, tmp_path):
    common = ["--json", "--set", "precision=fp32", "--set", "schedule.max_steps=25", "--set", "schedule.warmup_steps=5"]
    single = _summary(cli("run", QUICKSTART, *common, "--set", f"run_dir={tmp_path / 'one'}"))
    double = _summary(cli("run", QUICKSTART, "--nproc", "2", *common, "--set", f"run_dir={tmp_path / 'two'}"))
    assert double["world_size"] == 2 and single["world_size"] == 1
    assert double["replicas_agree"] is True
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=1e-5, atol=1e-5)
    losses_one = [r["loss"] for r in _metrics(tmp_path / "one") if r["kind"] == "train"]
    losses_two = [r["loss"] for r in _metrics(tmp_path / "two") if r["kind"] == "train"]
    assert losses_two == pytest.approx(losses_one, rel=1e-5)

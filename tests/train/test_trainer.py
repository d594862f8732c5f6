"""The Trainer in this process: determinism, options, schedules."""

from __future__ import annotations

import json
import math

import pytest
import torch

from skylift.config import load_config
from skylift.train.optim import build_optimizer, lr_multiplier
from skylift.train.trainer import Trainer


@pytest.fixture(autouse=True)
def _one_thread():
    # These fits run in this process: on two cores shared with other jobs, two OpenMP threads
    # wait on each other at every operator (a quickstart step: 78 ms on one thread, 816 ms on two).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(tmp_path, *overrides):
    # No HTML report: its PNGs cost more than these short fits, and no test here reads it.
    base = [f"run_dir={tmp_path}", "monitor.tensorboard=false", "monitor.progress_bar=off", "monitor.report=false",
            "checkpoint.enabled=false", "preemption.enabled=false", "schedule.warmup_steps=2"]
    return load_config("examples/quickstart.yaml", [*base, *overrides])


def _train_losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if record["kind"] == "train"]


def test_same_seed_same_run(tmp_path):
    first = Trainer(_config(tmp_path / "a", "schedule.max_steps=12", "precision=fp32")).fit()
    second = Trainer(_config(tmp_path / "b", "schedule.max_steps=12", "precision=fp32")).fit()
    assert _train_losses(tmp_path / "a") == _train_losses(tmp_path / "b")
    assert first.eval_metrics == second.eval_metrics


def test_resnet_with_channels_last_and_activation_checkpointing_trains(tmp_path):
    config = _config(
        tmp_path, "recipe.model=resnet18", "recipe.dataset=synthetic_images", "recipe.image_size=32",
        "recipe.num_samples=64", "data.global_batch_size=16", "schedule.max_steps=3", "channels_last=true",
        "activation_checkpointing.enabled=true", "recipe.num_classes=4",
    )
    trainer = Trainer(config)
    summary = trainer.fit()
    assert summary.steps == 3
    assert all(math.isfinite(loss) for loss in _train_losses(tmp_path))


@pytest.mark.slow
def test_torch_compile_path_trains(tmp_path):
    summary = Trainer(_config(tmp_path, "compile.enabled=true", "schedule.max_steps=3", "precision=fp32")).fit()
    assert summary.steps == 3
    assert all(math.isfinite(loss) for loss in _train_losses(tmp_path))


@pytest.mark.parametrize(
    ("shape", "at_end"), [("warmup_cosine", 0.1), ("warmup_linear", 0.1), ("constant", 1.0)]
)
def test_lr_schedules(shape, at_end):
    schedule = load_config(None, [f"schedule.lr_schedule={shape}", "schedule.warmup_steps=10",
                                  "schedule.min_lr_ratio=0.1"]).schedule
    assert lr_multiplier(0, schedule, 100) == pytest.approx(0.1)
    assert lr_multiplier(9, schedule, 100) == pytest.approx(1.0)
    assert lr_multiplier(100, schedule, 100) == pytest.approx(at_end)
    if shape == "warmup_cosine":
        assert lr_multiplier(55, schedule, 100) == pytest.approx(0.1 + 0.9 * 0.5)


@pytest.mark.parametrize(("implementation", "flag"), [("auto", "foreach"), ("fused", "fused"), ("for_loop", "foreach")])
def test_optimizer_kernels(implementation, flag):
    model = torch.nn.Linear(4, 4)
    config = load_config(None, [f"optim.implementation={implementation}"]).optim
    optimizer = build_optimizer(model, config, torch.device("cpu"))
    expected = implementation != "for_loop"
    assert optimizer.defaults[flag] is expected
    assert [len(group["params"]) for group in optimizer.param_groups] == [1, 1]  # bias without decay

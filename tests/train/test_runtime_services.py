"""The Runtime's survive-and-watch calls in this process: resume with the user's own state,
logging the user's scalars, and clear errors for calls that need a run configuration."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from skylift.config.load import load_config
from skylift.train.runtime import Runtime

OVERRIDES = ["precision=fp32", "checkpoint.every_steps=3", "checkpoint.every_minutes=null", "monitor.tensorboard=false",
             "monitor.system_interval_s=0", "monitor.log_every_steps=2", "preemption.enabled=false"]


def _runtime(run_dir, *extra: str) -> Runtime:
    return Runtime.from_config(load_config(None, [f"run_dir={run_dir}", *OVERRIDES, *extra]))


def _train(runtime: Runtime, steps: int, extra: dict | None = None, **scalars) -> int:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), batch_size=4, shuffle=True)
    model, optimizer, loader = runtime.prepare(model, optimizer, loader)
    step = runtime.resume(extra)
    for inputs, targets in loader:
        if step >= steps:
            break
        with runtime.autocast():
            loss = nn.functional.cross_entropy(model(inputs), targets)
        runtime.backward(loss)
        runtime.optimizer_step()
        step += 1
        if extra is not None:
            extra["ema"].mul_(0.5).add_(1.0)
            extra["best_loss"] = min(extra["best_loss"], loss.detach().item())
        runtime.log(step, loss=loss, **{name: value * step for name, value in scalars.items()})
        runtime.step_end(step)
    runtime.finish()
    runtime.services.close()
    return step


def test_the_users_own_state_comes_back_on_resume(tmp_path):
    saved = {"ema": torch.zeros(3), "best_loss": 10.0, "note": "warm"}
    assert _train(_runtime(tmp_path), steps=6, extra=saved) == 6
    mine = torch.full((3,), -1.0)
    restored = {"ema": mine, "best_loss": None, "note": None}
    runtime = _runtime(tmp_path)
    assert _train(runtime, steps=6, extra=restored) == 6  # resumed at the end: nothing left to do
    assert restored["ema"] is mine and torch.equal(mine, saved["ema"])  # filled in place
    assert restored["best_loss"] == saved["best_loss"] and restored["note"] == "warm"
    assert runtime.services.resumed_from_step == 6


def test_a_value_that_is_neither_a_tensor_nor_json_is_named(tmp_path):
    with pytest.raises(TypeError, match="extra state 'model' is a Linear: give a tensor or a JSON value"):
        _train(_runtime(tmp_path), steps=3, extra={"ema": torch.zeros(1), "best_loss": 1.0, "model": nn.Linear(1, 1)})


def test_own_scalars_are_written_with_the_train_records(tmp_path):
    _train(_runtime(tmp_path), steps=4, accuracy=torch.tensor(0.25))
    train = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert [record["accuracy"] for record in train] == [0.25, 0.5, 0.75, 1.0]
    assert all(record["samples_seen"] == 4 * record["step"] for record in train)


def test_a_scalar_named_like_a_skylift_field_is_refused(tmp_path):
    runtime = _runtime(tmp_path)
    with pytest.raises(ValueError, match=r"\['lr'\] are fields skylift writes itself"):
        runtime.log(1, loss=torch.tensor(1.0), lr=0.1)
    runtime.services.close()


def test_survive_calls_without_a_config_say_how_to_get_one():
    from skylift.loop.distributed import DistributedContext

    runtime = Runtime(precision="fp32", context=DistributedContext(0, 1, 0, torch.device("cpu"), None))
    for call in (runtime.resume, lambda: runtime.step_end(1), lambda: runtime.log(1, loss=1.0)):
        with pytest.raises(RuntimeError, match=r"Runtime.from_config\('run.yaml'\)"):
            call()

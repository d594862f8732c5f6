"""Capture and restore of the full training state; no pickle anywhere."""

from __future__ import annotations

import pickle
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from skylift.checkpoint.state import capture, restore_replicated, restore_rng

SOURCE = Path(__file__).resolve().parents[2] / "src" / "skylift"


def _objects(seed=0, scaler=False):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    return model, optimizer, scheduler, grad_scaler


def _step(model, optimizer, scheduler):
    loss = model(torch.randn(4, 8)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def test_round_trip_restores_everything_bitwise():
    model, optimizer, scheduler, scaler = _objects(scaler=True)
    for _ in range(3):
        _step(model, optimizer, scheduler)
    scaler.scale(torch.ones(()))  # initialises the scale tensor
    scaler.update(new_scale=512.0)
    random.random(), np.random.rand(), torch.rand(1)
    snapshot = capture(step=3, rank=0, model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                       counters={"step": 3, "epoch": 0, "samples_seen": 12})
    files = snapshot.serialize()
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(3))
    _step(model, optimizer, scheduler)  # move on, so restoring has something to undo

    fresh_model, fresh_optimizer, fresh_scheduler, fresh_scaler = _objects(seed=1, scaler=True)
    counters = restore_replicated(files, model=fresh_model, optimizer=fresh_optimizer,
                                  scheduler=fresh_scheduler, scaler=fresh_scaler)
    restore_rng(files["rng-rank0.safetensors"], files["rng-rank0.json"])
    assert counters == {"step": 3, "epoch": 0, "samples_seen": 12}
    assert (random.random(), float(np.random.rand())) == expected_draws[:2]
    assert torch.equal(torch.rand(3), expected_draws[2])
    assert fresh_scheduler.last_epoch == 3 and fresh_scaler.get_scale() == 512.0
    for name, tensor in snapshot.tensors["model.safetensors"].items():
        assert torch.equal(fresh_model.state_dict()[name], tensor)
    saved_state = snapshot.tensors["optimizer.safetensors"]
    for index, entries in fresh_optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            assert torch.equal(value, saved_state[f"{index}/{key}"])


def test_snapshot_is_a_copy_not_a_view():
    model, optimizer, scheduler, _ = _objects()
    _step(model, optimizer, scheduler)
    snapshot = capture(step=1, rank=0, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
                       counters={"step": 1, "epoch": 0, "samples_seen": 4})
    frozen = {name: tensor.clone() for name, tensor in snapshot.tensors["model.safetensors"].items()}
    _step(model, optimizer, scheduler)
    for name, tensor in snapshot.tensors["model.safetensors"].items():
        assert torch.equal(tensor, frozen[name])


def test_blocking_capture_writes_host_tensors_in_place_and_the_same_bytes():
    model, optimizer, scheduler, _ = _objects()
    _step(model, optimizer, scheduler)
    options = dict(step=1, rank=0, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
                   counters={"step": 1, "epoch": 0, "samples_seen": 4})
    copied = capture(**options)
    in_place = capture(**options, reference_host_tensors=True)
    weight = in_place.tensors["model.safetensors"]["0.weight"]
    assert weight.data_ptr() == model[0].weight.data_ptr(), "no copy for a save written before training goes on"
    assert copied.tensors["model.safetensors"]["0.weight"].data_ptr() != model[0].weight.data_ptr()
    assert in_place.serialize() == copied.serialize()


def test_other_ranks_save_only_their_rng():
    model, optimizer, scheduler, _ = _objects()
    snapshot = capture(step=1, rank=3, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None, counters={})
    assert sorted(snapshot.serialize()) == ["rng-rank3.json", "rng-rank3.safetensors"]


class _Payload:
    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self):
        return (Path.touch, (self.canary,))


def test_a_checkpoint_crafted_to_run_code_is_refused(tmp_path):
    canary = tmp_path / "pwned"
    model, optimizer, scheduler, _ = _objects()
    files = capture(step=1, rank=0, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None,
                    counters={"step": 1, "epoch": 0, "samples_seen": 4}).serialize()
    evil = pickle.dumps({"weight": _Payload(canary)})
    for name in ("model.safetensors", "optimizer.safetensors"):
        crafted = dict(files, **{name: evil})
        with pytest.raises(Exception) as caught:
            restore_replicated(crafted, model=model, optimizer=optimizer, scheduler=scheduler, scaler=None)
        assert not canary.exists(), f"unpickling {name} ran code"
        assert "pickle" not in type(caught.value).__module__
    with pytest.raises(ValueError):
        restore_replicated(dict(files, **{"trainer.json": evil}), model=model, optimizer=optimizer,
                           scheduler=scheduler, scaler=None)
    assert not canary.exists()


def test_no_unsafe_deserialisation_in_the_package():
    offenders = []
    pattern = re.compile(r"weights_only\s*=\s*False|pickle\.loads?\(|torch\.load\(|Unpickler")
    for path in SOURCE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(SOURCE)}:{number}: {line.strip()}")
    assert offenders == []


def test_streamed_safetensors_load_with_the_reference_reader():
    from safetensors.torch import load

    from skylift.checkpoint.state import Snapshot

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "int": torch.arange(7),
        "flag": torch.tensor([True, False]),
        "strided": torch.randn(6, 4).t(),
    }
    loaded = load(Snapshot(1, tensors={"t.safetensors": tensors}).serialize()["t.safetensors"])
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype

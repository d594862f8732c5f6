"""Helpers for tests that train real runs in subprocesses and compare them bitwise."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import run_cli

# fp32 and deterministic kernels: a resumed run must equal the uninterrupted one bit for bit.
EXACT = (
    "precision=fp32",
    "deterministic=true",
    "schedule.max_steps=60",
    "schedule.warmup_steps=10",
    "checkpoint.every_steps=7",
    "checkpoint.every_minutes=null",
    "monitor.log_every_steps=5",
    "monitor.tensorboard=false",
)


LEAN = ("monitor.report=false",)
"""With ``--no-doctor``: what :func:`lean_train` adds. The doctor's start-up checks (a
memory trace of the model) and the HTML report's PNGs cost about half of a quickstart
run's ~6 s; neither touches the checkpoints, and their own tests cover them."""


def train(run_dir: Path, *overrides: str, nproc: int = 1, env: dict[str, str] | None = None, timeout_s: float = 300,
          lean: bool = False):
    args = ["run", "examples/quickstart.yaml", "--json", "--set", f"run_dir={run_dir}"]
    if lean:
        args.append("--no-doctor")
    for override in (*EXACT, *(LEAN if lean else ()), *overrides):
        args += ["--set", override]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    return run_cli(*args, env=env, timeout_s=timeout_s)


def lean_train(run_dir: Path, *overrides: str, **kwargs):
    """:func:`train` without the doctor's checks and the HTML report (see :data:`LEAN`)."""
    return train(run_dir, *overrides, lean=True, **kwargs)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last loss written for each step (a resumed run rewrites the steps it redoes)."""
    return {record["step"]: record["loss"] for record in records(run_dir, "train")}


def assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"parameter {name} differs from the uninterrupted run"
    assert losses_by_step(run_dir) == losses_by_step(reference)

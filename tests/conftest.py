"""Shared fixtures: run the real CLI in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "examples"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_cli(*args: str, timeout_s: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m skylift ARGS`` from the repository root; output captured as text."""
    merged = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "skylift", *args],
        cwd=REPO_ROOT,
        env=merged,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def moto_server():
    """One moto S3 server on 127.0.0.1 for the session, with sentinel credentials."""
    from tests.servers import S3_ENVIRONMENT, MotoServer

    saved = {name: os.environ.get(name) for name in S3_ENVIRONMENT}
    os.environ.update(S3_ENVIRONMENT)
    server = MotoServer().start()
    yield server
    server.stop()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def s3_bucket(moto_server):
    """A fresh, empty bucket; returns its name."""
    moto_server.reset()
    moto_server.create_bucket("skylift-test")
    return "skylift-test"

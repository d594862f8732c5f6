from __future__ import annotations

import pytest

from skylift.storage import open_store
from tests.checkpoint.runs import lean_train, lean_train_in_fixture


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """An empty checkpoint root: a local folder, or a prefix on the moto S3 server."""
    if request.param == "local":
        return open_store(str(tmp_path / "root"))
    moto_server = request.getfixturevalue("moto_server")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The uninterrupted single-process run that killed-and-resumed runs must equal. In this
    process (:func:`~tests.checkpoint.runs.lean_train_in_fixture`): nothing about it is a
    process boundary, and on one thread it equals :func:`lean_train`'s subprocess bit for bit."""
    run_dir = tmp_path_factory.mktemp("reference")
    result = lean_train_in_fixture(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def reference_ddp(tmp_path_factory):
    """The same, on two processes (DDP over gloo)."""
    run_dir = tmp_path_factory.mktemp("reference-ddp")
    result = lean_train(run_dir, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir

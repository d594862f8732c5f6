"""Which checkpoint an export reads (``full_model_state``, what ``skylift export`` builds
on): the newest of the current timeline, as auto-resume would take, and a checkpoint that
cannot be read stops the export naming the cause instead of quietly giving an older one."""

from __future__ import annotations

import logging

import pytest

from skylift.checkpoint.consolidate import full_model_state
from skylift.storage import StoragePermanentError, StorageTransientError, open_store
from skylift.storage.retry import RetryPolicy
from tests.checkpoint.attempts import FAST_RETRY, corrupt, iam_denied, run_attempt


def _exported_step(root: str, **options) -> tuple[int, float]:
    """(step, the step number its weights mark) of what an export of "the newest" reads."""
    step, weights = full_model_state(root, **options)
    return step, float(weights["weight"][0, 0])


def test_export_after_a_rollback_takes_the_rollback_step_not_the_abandoned_newest(tmp_path):
    """A rollback resume of step 20 while 25 and 30 exist, before its first commit: 25 and
    30 are abandoned (auto-resume takes 20), so "the newest" to export is 20."""
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30)
    assert run_attempt(root, resume=f"{root}/step-20") == 20
    assert _exported_step(root) == (20, 20.0)


def test_export_after_the_rollback_commits_takes_the_new_timeline(tmp_path):
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30, keep=5)
    run_attempt(root, 22, resume=f"{root}/step-20", keep=5)
    assert _exported_step(root) == (22, 22.0)


def test_export_skips_a_corrupt_newest_with_a_warning(tmp_path, caplog):
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30)
    corrupt(open_store(root), 30)
    with caplog.at_level(logging.WARNING, logger="skylift"):
        assert _exported_step(root) == (25, 25.0)
    assert "skipping checkpoint" in caplog.text and "step-30" in caplog.text


@pytest.fixture
def s3_root(moto_server, s3_bucket):
    return f"s3://{s3_bucket}/run"


def test_a_denied_read_stops_the_export_naming_the_cause(moto_server, s3_bucket, s3_root, monkeypatch):
    """A 403 is no proof the newest checkpoint is bad: exporting step 56 instead would be silent loss."""
    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    with iam_denied(moto_server, s3_bucket, monkeypatch, "s3:GetObject", "run/step-58/model.safetensors"):
        with pytest.raises(StoragePermanentError) as caught:
            full_model_state(s3_root, endpoint_url=moto_server.endpoint_url)
    message = str(caught.value)
    assert message.startswith("cannot export: s3://skylift-test/run/step-58 could not be read"), message
    assert "step-58/model.safetensors: access denied" in message
    assert "no older checkpoint was taken instead" in message


def test_a_denied_manifest_read_stops_the_export(moto_server, s3_bucket, s3_root, monkeypatch):
    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    with iam_denied(moto_server, s3_bucket, monkeypatch, "s3:GetObject", "run/step-*"):
        with pytest.raises(StoragePermanentError, match=r"^cannot export: .*access denied"):
            full_model_state(s3_root, endpoint_url=moto_server.endpoint_url)


def test_an_endpoint_that_stops_answering_stops_the_export(moto_server, s3_root):
    from tests.servers import FaultyProxy

    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    proxy = FaultyProxy(moto_server.port)
    try:
        proxy.fail(1000, 503, when=lambda method, path: method == "GET" and "/step-58/model" in path)
        store = open_store(s3_root, endpoint_url=proxy.endpoint_url)
        store.retry = RetryPolicy(**FAST_RETRY)
        with pytest.raises(StorageTransientError, match=r"^cannot export: .*step-58.*failed after 3 attempts"):
            full_model_state(store)
    finally:
        proxy.close()

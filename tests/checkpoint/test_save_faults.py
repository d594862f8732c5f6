"""Save under faults: access denied (moto's own IAM evaluation of a policy denying
``s3:PutObject``) or an endpoint that stops answering, at save time. The run keeps its last
committed checkpoint, never reports a step committed that is not, and a run whose final
state is not committed exits 1 with one line naming the newest committed step.

Runs go through tests/checkpoint/attempts.py (a checkpoint session in this process, as the
Runtime wires it), and end to end through ``skylift run`` (slow lane).
"""

from __future__ import annotations

import pytest

from skylift.checkpoint.manifest import LATEST, committed_steps
from skylift.storage import open_store
from skylift.storage.retry import RetryPolicy
from tests.checkpoint.attempts import FAST_RETRY, Attempt, iam_denied, run_attempt, weight_of


@pytest.fixture
def s3_root(moto_server, s3_bucket):
    return f"s3://{s3_bucket}/run"


def _root_store(moto_server, s3_root):
    return open_store(s3_root, endpoint_url=moto_server.endpoint_url)


@pytest.mark.parametrize("denied", ["run/step-58/*", "run/step-58/manifest.json"], ids=["every file", "manifest"])
def test_a_save_denied_is_not_committed_and_the_last_commit_stands(moto_server, s3_bucket, s3_root, monkeypatch,
                                                                   denied):
    """Denied for the step's files, or only for its manifest (the commit point, written
    after every file): the save is reported abandoned, naming access denied, and the root
    still resumes step 56."""
    with iam_denied(moto_server, s3_bucket, monkeypatch, "s3:PutObject", denied):
        with Attempt(s3_root, endpoint_url=moto_server.endpoint_url) as attempt:
            attempt.resume()
            attempt.save(54, 56)
            result = attempt.try_save(58)
            last = attempt.session.manager.last_committed
    assert result is not None and not result.committed
    assert "access denied" in (result.error or "").lower(), result.error
    assert last is not None and last.step == 56
    store = _root_store(moto_server, s3_root)
    assert committed_steps(store) == [54, 56]
    assert store.read_bytes(LATEST) == b"step-56\n"
    assert run_attempt(s3_root, endpoint_url=moto_server.endpoint_url) == 56
    assert weight_of(store, 56) == 56.0


def test_a_denied_latest_after_the_manifest_is_still_a_commit(moto_server, s3_bucket, s3_root, monkeypatch):
    """The manifest is the commit point: once it is written the save is committed (and
    resumed), even if LATEST, bookkeeping for tools, cannot be updated."""
    with iam_denied(moto_server, s3_bucket, monkeypatch, "s3:PutObject", "run/LATEST"):
        with Attempt(s3_root, endpoint_url=moto_server.endpoint_url) as attempt:
            attempt.resume()
            result = attempt.try_save(58)
    assert result is not None and result.committed, result and result.error
    assert committed_steps(_root_store(moto_server, s3_root)) == [58]
    assert run_attempt(s3_root, endpoint_url=moto_server.endpoint_url) == 58


@pytest.mark.slow
def test_an_endpoint_that_stops_answering_at_save_commits_nothing(moto_server, s3_root):
    """After two commits every connection is dropped unanswered (a dead endpoint): the save
    is abandoned once its retries give up, and the root still holds 54 and 56 as they were.
    Slow lane: the save, its clean-up and the lease's release each wait out botocore's
    connection retries (about a minute in all on two loaded cores)."""
    from tests.servers import FaultyProxy

    proxy = FaultyProxy(moto_server.port)
    try:
        with Attempt(s3_root, endpoint_url=proxy.endpoint_url, retry=RetryPolicy(**FAST_RETRY)) as attempt:
            attempt.resume()
            attempt.save(54, 56)
            proxy.drop_every()
            result = attempt.try_save(58)
            last = attempt.session.manager.last_committed
            proxy.close()  # the lease's release at close fails fast on a closed port
    finally:
        proxy.close()
    assert result is not None and not result.committed
    assert "StorageTransientError" in (result.error or "") and "after 3 attempts" in result.error, result.error
    assert last is not None and last.step == 56
    store = _root_store(moto_server, s3_root)
    assert committed_steps(store) == [54, 56]
    assert store.read_bytes(LATEST) == b"step-56\n"


@pytest.mark.slow
def test_skylift_run_whose_final_save_is_denied_exits_1_naming_the_last_commit(moto_server, s3_bucket, s3_root,
                                                                               monkeypatch, tmp_path, cli_here):
    """End to end: saves at 7, 14, ..., 56 commit; the final state's (step 60) is denied.
    The run trains to the end, but a final state not committed is no success: exit 1, one
    line naming step 60, the cause and the newest committed step (56)."""
    from tests.checkpoint.runs import lean_train_here, records

    run_dir = tmp_path / "run"
    with iam_denied(moto_server, s3_bucket, monkeypatch, "s3:PutObject", "run/step-60/*"):
        result = lean_train_here(cli_here, run_dir, f"checkpoint.root={s3_root}",
                                 f"checkpoint.endpoint_url={moto_server.endpoint_url}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("skylift run: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "final state (step 60) is not committed" in lines[0] and "access denied" in lines[0].lower(), lines[0]
    assert "newest committed checkpoint is step 56" in lines[0], lines[0]
    assert committed_steps(_root_store(moto_server, s3_root))[-1] == 56
    saves = records(run_dir, "checkpoint")
    assert [record["step"] for record in saves if record["committed"]][-1] == 56
    assert not any(record["committed"] for record in saves if record["step"] == 60)

"""Resume under faults: a checkpoint that cannot be read stops the resume, one proven
corrupt is skipped, and a rollback starts a timeline that auto-resume and retention follow.

Runs go through tests/checkpoint/attempts.py: a checkpoint session in this process with a
tiny model, wired as the Runtime wires it; a "kill" is a session that stops saving. S3 is
the moto server on 127.0.0.1; access denied comes from moto's own IAM policy evaluation, a
dead endpoint from a closed loopback port.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from skylift.checkpoint.manifest import LATEST, committed_steps, read_manifest
from skylift.storage import StoragePermanentError, StorageTransientError, open_store
from skylift.storage.retry import RetryPolicy
from tests.checkpoint.attempts import FAST_RETRY, Attempt, corrupt, iam_denied, run_attempt, weight_of
from tests.servers import free_port

# -- permanent and transient storage errors at resume ------------------------------------------


@pytest.fixture
def s3_root(moto_server, s3_bucket):
    return f"s3://{s3_bucket}/run"


@pytest.fixture
def denied_step_reads(moto_server, s3_bucket, monkeypatch):
    """Credentials of an IAM user that may list and write the root but not read its
    checkpoints (``s3:GetObject`` denied on ``run/step-*``), with moto enforcing IAM."""
    yield from _denied_reads(moto_server, s3_bucket, monkeypatch, "run/step-*")


@pytest.fixture
def denied_rank_1_files(moto_server, s3_bucket, monkeypatch):
    """The same, denying only rank 1's files of step 58 (its RNG state)."""
    yield from _denied_reads(moto_server, s3_bucket, monkeypatch, "run/step-58/rng-rank1.*")


@pytest.fixture
def denied_newest_weights(moto_server, s3_bucket, monkeypatch):
    """The same, denying only ``run/step-58/model.safetensors``: its manifest reads."""
    yield from _denied_reads(moto_server, s3_bucket, monkeypatch, "run/step-58/model.safetensors")


def _denied_reads(moto_server, s3_bucket, monkeypatch, denied: str):
    with iam_denied(moto_server, s3_bucket, monkeypatch, "s3:GetObject", denied):
        yield


def test_denied_checkpoint_reads_stop_the_resume_naming_the_cause(moto_server, s3_root, request):
    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    request.getfixturevalue("denied_step_reads")
    with Attempt(s3_root, endpoint_url=moto_server.endpoint_url) as attempt:
        with pytest.raises(StoragePermanentError) as caught:
            attempt.resume()
    message = str(caught.value)
    assert "access denied" in message and "step-5" in message, message
    assert "no checkpoint was skipped and the run did not start over" in message


def test_denied_reads_leave_every_checkpoint_in_place(moto_server, s3_root, request):
    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    request.getfixturevalue("denied_step_reads")
    with Attempt(s3_root, endpoint_url=moto_server.endpoint_url) as attempt:
        with pytest.raises(StoragePermanentError):
            attempt.resume()
    store = open_store(s3_root, endpoint_url=moto_server.endpoint_url)
    assert committed_steps(store) == [54, 56, 58]


def test_a_denied_file_of_the_newest_checkpoint_stops_the_resume_instead_of_skipping_it(moto_server, s3_root,
                                                                                        request):
    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    request.getfixturevalue("denied_newest_weights")
    with Attempt(s3_root, endpoint_url=moto_server.endpoint_url) as attempt:
        with pytest.raises(StoragePermanentError) as caught:
            attempt.resume()
    message = str(caught.value)
    assert message.startswith("cannot resume: s3://skylift-test/run/step-58 could not be read"), message
    assert "step-58/model.safetensors: access denied" in message


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_read_denied_to_one_rank_stops_every_rank(moto_server, s3_root, tmp_path, request):
    """Rank 1 alone cannot read its files of step 58: both ranks stop (neither hangs in a
    collective, neither goes back to step 56)."""
    from tests.gloo_group import spawn_ranks

    spawn_ranks(_two_ranks, 2, "save", s3_root, moto_server.endpoint_url, str(tmp_path))
    request.getfixturevalue("denied_rank_1_files")
    spawn_ranks(_two_ranks, 2, "resume", s3_root, moto_server.endpoint_url, str(tmp_path))
    outcomes = [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)]
    assert outcomes[1].startswith("StoragePermanentError: cannot resume: s3://skylift-test/run/step-58"), outcomes
    assert "step-58/rng-rank1" in outcomes[1] and "access denied" in outcomes[1]
    assert outcomes[0].startswith("StorageError: cannot resume: another rank could not read"), outcomes


def _two_ranks(rank: int, world_size: int, port: int, task: str, root: str, endpoint_url: str, results: str) -> None:
    """One rank of a two-process job (gloo): ``save`` steps 54, 56, 58, or ``resume`` and
    write what happened to ``results/rank-<R>.txt``."""
    import torch.distributed as dist

    from tests.gloo_group import join

    torch.set_num_threads(1)
    join(rank, world_size, port)
    try:
        with Attempt(root, endpoint_url=endpoint_url, rank=rank, world_size=world_size) as attempt:
            if task == "save":
                attempt.resume()
                attempt.save(54, 56, 58)
                return
            try:
                outcome = f"resumed {attempt.resume()}"
            except Exception as error:
                outcome = f"{type(error).__name__}: {error}"
            Path(results, f"rank-{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_an_endpoint_that_stops_answering_reads_stops_the_resume(moto_server, s3_root):
    """Reads that time out (the retries give up) are not proof of a corrupt checkpoint."""
    from tests.servers import FaultyProxy

    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    proxy = FaultyProxy(moto_server.port)
    try:
        proxy.fail(1000, 503, when=lambda method, path: method == "GET" and "/step-" in path)
        with Attempt(s3_root, endpoint_url=proxy.endpoint_url, retry=RetryPolicy(**FAST_RETRY)) as attempt:
            with pytest.raises(StorageTransientError) as caught:
                attempt.resume()
    finally:
        proxy.close()
    assert re.search(r"cannot resume.*step-5\d/manifest.json failed after 3 attempts", str(caught.value))


def test_a_dead_endpoint_at_resume_fails_at_once(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(StorageTransientError, match="after 3 attempts"):
        with Attempt("s3://skylift-test/run", endpoint_url=dead, retry=RetryPolicy(**FAST_RETRY)) as attempt:
            attempt.resume()


def test_a_missing_file_is_proof_of_an_incomplete_checkpoint_and_is_skipped(moto_server, s3_root, caplog):
    run_attempt(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    store = open_store(s3_root, endpoint_url=moto_server.endpoint_url)
    store.delete(["step-58/optimizer.json"])  # a 404 for a file the manifest lists
    with caplog.at_level(logging.WARNING, logger="skylift"):
        assert run_attempt(s3_root, endpoint_url=moto_server.endpoint_url) == 56
    assert "step-58/optimizer.json is listed in the manifest but missing" in caplog.text


# -- retention and auto-resume follow the current timeline -------------------------------------


def test_a_fresh_start_over_corrupt_checkpoints_keeps_its_own_new_ones(tmp_path, caplog):
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30)
    store = open_store(root)
    for step in (20, 25, 30):
        corrupt(store, step)
    with caplog.at_level(logging.WARNING, logger="skylift"):
        assert run_attempt(root, 5, 10, 15) is None  # killed at 18
    assert "no checkpoint" in caplog.text and "starting from step 0" in caplog.text
    assert committed_steps(store) == [5, 10, 15]
    assert store.read_bytes(LATEST) == b"step-15\n"
    assert run_attempt(root) == 15


def test_a_rollback_is_not_undone_by_the_next_auto_resume(tmp_path):
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30)
    assert run_attempt(root, 25, resume=f"{root}/step-20") == 20  # killed at 28
    store = open_store(root)
    assert store.read_bytes(LATEST) == b"step-25\n"
    assert run_attempt(root) == 25
    assert weight_of(store, 25) == 25.0
    assert 30 not in committed_steps(store), "step 30 of the abandoned timeline is removed once the new one commits"


def test_a_rollback_killed_before_its_first_save_is_still_a_rollback(tmp_path):
    """The new timeline is recorded before training starts, and nothing is deleted until it commits."""
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30)
    assert run_attempt(root, resume=f"{root}/step-20") == 20  # killed before its first save
    store = open_store(root)
    assert committed_steps(store) == [20, 25, 30]
    assert store.read_bytes(LATEST) == b"step-20\n"
    assert run_attempt(root) == 20


def test_an_explicit_resume_of_an_abandoned_step_makes_it_current_again(tmp_path):
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30)
    assert run_attempt(root, resume=f"{root}/step-20") == 20
    assert run_attempt(root, resume=f"{root}/step-30") == 30
    assert run_attempt(root, 35) == 30
    assert committed_steps(open_store(root))[-2:] == [30, 35]
    assert run_attempt(root) == 35


def test_skipping_a_corrupt_newest_abandons_it_and_keeps_the_resumed_timeline(tmp_path):
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25, 30)
    store = open_store(root)
    corrupt(store, 30)
    assert run_attempt(root, 26) == 25
    assert committed_steps(store) == [20, 25, 26]
    assert run_attempt(root) == 26


def test_a_manifest_without_a_timeline_is_read_as_the_first_timeline(tmp_path):
    """Checkpoints written before timelines resume, and are kept beside the new ones."""
    root = str(tmp_path / "root")
    run_attempt(root, 20, 25)
    store = open_store(root)
    for step in (20, 25):
        payload = json.loads(store.read_bytes(f"step-{step}/manifest.json"))
        payload.pop("timeline", None)
        store.write_bytes(f"step-{step}/manifest.json", json.dumps(payload).encode())
    assert read_manifest(store, 25).timeline == (("0", None),)
    assert run_attempt(root, 30) == 25
    assert committed_steps(store) == [20, 25, 30]


@pytest.mark.slow
def test_skylift_run_killed_after_a_rollback_resumes_the_rollback(tmp_path, cli_here):
    """End to end: a finished run (saves 7, 14, 21, 28, 30; keep 5), an explicit resume of
    step 14 killed (SIGKILL) at step 24, then ``--resume auto`` as a platform's restart runs it."""
    from tests.checkpoint.runs import lean_train, lean_train_here, summary

    run_dir = tmp_path / "run"
    steps = ("schedule.max_steps=30", "checkpoint.keep=5")
    assert lean_train_here(cli_here, run_dir, *steps).returncode == 0
    # Step 21's save blocks the step: an async one may still be writing when step 24's kill
    # lands on a loaded machine, and then 14 is rightly the newest commit of the rollback.
    rollback = lean_train(run_dir, *steps, f"checkpoint.resume={run_dir / 'checkpoints' / 'step-14'}",
                          "checkpoint.async_save=false", env={"SKYLIFT_FAULT_INJECTION": "step_end:step=24"})
    assert rollback.returncode == -9, rollback.stderr[-2000:]
    restart = lean_train_here(cli_here, run_dir, *steps)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 21
    assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == 30

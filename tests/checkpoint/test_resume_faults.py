"""Resume under faults: a checkpoint that cannot be read stops the resume, one proven
corrupt is skipped, and a rollback starts a timeline that auto-resume and retention follow.

Runs go through :class:`~skylift.checkpoint.session.Checkpointing` in this process, wired as
the Runtime wires it (``open``, ``resume``, ``save``, ``close``), with a tiny model: the
storage and the checkpoint bookkeeping are under test, not training. A "kill" is a session
that stops saving (its lease is released so the next attempt may start at once; what a kill
leaves in the root is the same). S3 is the moto server on 127.0.0.1; access denied comes
from moto's own IAM policy evaluation, a dead endpoint from a closed loopback port.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load
from torch import nn

from skylift.checkpoint.manifest import LATEST, committed_steps, read_manifest
from skylift.checkpoint.session import Checkpointing, TrainingObjects
from skylift.config.checkpoint import CheckpointConfig
from skylift.loop.agreement import StepAgreement
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import TrainState
from skylift.storage import StoragePermanentError, StorageTransientError, open_store
from skylift.storage.retry import RetryPolicy
from tests.servers import free_port

FAST_RETRY = dict(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05, deadline_s=5.0)


class Attempt:
    """One start of a run on ``root``: open (lease), resume, then saves at chosen steps."""

    def __init__(self, root: str, *, resume: str = "auto", keep: int = 3, endpoint_url: str | None = None,
                 retry: RetryPolicy | None = None, rank: int = 0, world_size: int = 1) -> None:
        config = CheckpointConfig(root=root, endpoint_url=endpoint_url, every_steps=None, every_minutes=None,
                                  keep=keep, resume=resume, async_save=False)
        context = DistributedContext(rank, world_size, rank, torch.device("cpu"), "gloo" if world_size > 1 else None)
        group = None
        if world_size > 1:
            import torch.distributed as dist

            group = dist.new_group(backend="gloo")
        self.session = Checkpointing(config, run_dir=Path("/nonexistent-run-dir"), context=context,
                                     agreement=StepAgreement(group, distributed=world_size > 1), control_group=group)
        if retry is not None:
            self.session.store.retry = retry
        torch.manual_seed(0)
        self.model = nn.Linear(3, 2)
        self.state = TrainState(total_steps=100, steps_per_epoch=100, global_batch_size=4)

    def __enter__(self) -> Attempt:
        self.session.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.session.close()

    def resume(self) -> int | None:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        return self.session.resume(TrainingObjects(self.model, optimizer, None, None), self.state)

    def save(self, *steps: int) -> None:
        """Save at each step, the weights marking it (every weight equals the step number)."""
        for step in steps:
            with torch.no_grad():
                self.model.weight.fill_(float(step))
            self.state.step = step
            result = self.session.save(self.state)
            assert result is not None and result.committed, result and result.error


def _run(root: str, *saves: int, **options) -> int | None:
    """An attempt that resumes, saves at ``saves`` and stops; returns the step it resumed from."""
    with Attempt(root, **options) as attempt:
        resumed = attempt.resume()
        attempt.save(*saves)
    return resumed


def _weight_of(store, step: int) -> float:
    """The step number the saved weights mark (tells a re-done step from the abandoned one)."""
    return float(load(store.read_bytes(f"step-{step}/model.safetensors"))["weight"][0, 0])


def _corrupt(store, step: int) -> None:
    key = f"step-{step}/model.safetensors"
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(key, bytes(data))


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
    import boto3
    import requests

    iam = boto3.client("iam", endpoint_url=moto_server.endpoint_url, region_name="us-east-1")
    user = f"trainer-{free_port()}"
    iam.create_user(UserName=user)
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{s3_bucket}/{denied}"},
    ]}  # fmt: skip
    iam.put_user_policy(UserName=user, PolicyName="no-checkpoint-reads", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    reset = f"{moto_server.endpoint_url}/moto-api/reset-auth"
    previous = requests.post(reset, data=b"0", timeout=10).json()["PREVIOUS_INITIAL_NO_AUTH_ACTION_COUNT"]
    try:
        yield
    finally:
        requests.post(reset, data=str(previous).encode(), timeout=10)


def test_denied_checkpoint_reads_stop_the_resume_naming_the_cause(moto_server, s3_root, request):
    _run(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    request.getfixturevalue("denied_step_reads")
    with Attempt(s3_root, endpoint_url=moto_server.endpoint_url) as attempt:
        with pytest.raises(StoragePermanentError) as caught:
            attempt.resume()
    message = str(caught.value)
    assert "access denied" in message and "step-5" in message, message
    assert "no checkpoint was skipped and the run did not start over" in message


def test_denied_reads_leave_every_checkpoint_in_place(moto_server, s3_root, request):
    _run(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    request.getfixturevalue("denied_step_reads")
    with Attempt(s3_root, endpoint_url=moto_server.endpoint_url) as attempt:
        with pytest.raises(StoragePermanentError):
            attempt.resume()
    store = open_store(s3_root, endpoint_url=moto_server.endpoint_url)
    assert committed_steps(store) == [54, 56, 58]


def test_a_denied_file_of_the_newest_checkpoint_stops_the_resume_instead_of_skipping_it(moto_server, s3_root,
                                                                                        request):
    _run(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
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
            except Exception as error:  # noqa: BLE001 - the test reads what each rank raised
                outcome = f"{type(error).__name__}: {error}"
            Path(results, f"rank-{rank}.txt").write_text(outcome)
    finally:
        dist.destroy_process_group()


def test_an_endpoint_that_stops_answering_reads_stops_the_resume(moto_server, s3_root):
    """Reads that time out (the retries give up) are not proof of a corrupt checkpoint."""
    from tests.servers import FaultyProxy

    _run(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
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
    _run(s3_root, 54, 56, 58, endpoint_url=moto_server.endpoint_url)
    store = open_store(s3_root, endpoint_url=moto_server.endpoint_url)
    store.delete(["step-58/optimizer.json"])  # a 404 for a file the manifest lists
    with caplog.at_level(logging.WARNING, logger="skylift"):
        assert _run(s3_root, endpoint_url=moto_server.endpoint_url) == 56
    assert "step-58/optimizer.json is listed in the manifest but missing" in caplog.text


# -- retention and auto-resume follow the current timeline -------------------------------------


def test_a_fresh_start_over_corrupt_checkpoints_keeps_its_own_new_ones(tmp_path, caplog):
    root = str(tmp_path / "root")
    _run(root, 20, 25, 30)
    store = open_store(root)
    for step in (20, 25, 30):
        _corrupt(store, step)
    with caplog.at_level(logging.WARNING, logger="skylift"):
        assert _run(root, 5, 10, 15) is None  # killed at 18
    assert "no checkpoint" in caplog.text and "starting from step 0" in caplog.text
    assert committed_steps(store) == [5, 10, 15]
    assert store.read_bytes(LATEST) == b"step-15\n"
    assert _run(root) == 15


def test_a_rollback_is_not_undone_by_the_next_auto_resume(tmp_path):
    root = str(tmp_path / "root")
    _run(root, 20, 25, 30)
    assert _run(root, 25, resume=f"{root}/step-20") == 20  # killed at 28
    store = open_store(root)
    assert store.read_bytes(LATEST) == b"step-25\n"
    assert _run(root) == 25
    assert _weight_of(store, 25) == 25.0
    assert 30 not in committed_steps(store), "step 30 of the abandoned timeline is removed once the new one commits"


def test_a_rollback_killed_before_its_first_save_is_still_a_rollback(tmp_path):
    """The new timeline is recorded before training starts, and nothing is deleted until it commits."""
    root = str(tmp_path / "root")
    _run(root, 20, 25, 30)
    assert _run(root, resume=f"{root}/step-20") == 20  # killed before its first save
    store = open_store(root)
    assert committed_steps(store) == [20, 25, 30]
    assert store.read_bytes(LATEST) == b"step-20\n"
    assert _run(root) == 20


def test_an_explicit_resume_of_an_abandoned_step_makes_it_current_again(tmp_path):
    root = str(tmp_path / "root")
    _run(root, 20, 25, 30)
    assert _run(root, resume=f"{root}/step-20") == 20
    assert _run(root, resume=f"{root}/step-30") == 30
    assert _run(root, 35) == 30
    assert committed_steps(open_store(root))[-2:] == [30, 35]
    assert _run(root) == 35


def test_skipping_a_corrupt_newest_abandons_it_and_keeps_the_resumed_timeline(tmp_path):
    root = str(tmp_path / "root")
    _run(root, 20, 25, 30)
    store = open_store(root)
    _corrupt(store, 30)
    assert _run(root, 26) == 25
    assert committed_steps(store) == [20, 25, 26]
    assert _run(root) == 26


def test_a_manifest_without_a_timeline_is_read_as_the_first_timeline(tmp_path):
    """Checkpoints written before timelines resume, and are kept beside the new ones."""
    root = str(tmp_path / "root")
    _run(root, 20, 25)
    store = open_store(root)
    for step in (20, 25):
        payload = json.loads(store.read_bytes(f"step-{step}/manifest.json"))
        payload.pop("timeline", None)
        store.write_bytes(f"step-{step}/manifest.json", json.dumps(payload).encode())
    assert read_manifest(store, 25).timeline == (("0", None),)
    assert _run(root, 30) == 25
    assert committed_steps(store) == [20, 25, 30]


@pytest.mark.slow
def test_skylift_run_killed_after_a_rollback_resumes_the_rollback(tmp_path, cli_here):
    """End to end: a finished run (saves 7, 14, 21, 28, 30; keep 5), an explicit resume of
    step 14 killed (SIGKILL) at step 24, then ``--resume auto`` as a platform's restart runs it."""
    from tests.checkpoint.runs import lean_train, lean_train_here, summary

    run_dir = tmp_path / "run"
    steps = ("schedule.max_steps=30", "checkpoint.keep=5")
    assert lean_train_here(cli_here, run_dir, *steps).returncode == 0
    rollback = lean_train(run_dir, *steps, f"checkpoint.resume={run_dir / 'checkpoints' / 'step-14'}",
                          env={"SKYLIFT_FAULT_INJECTION": "step_end:step=24"})
    assert rollback.returncode == -9, rollback.stderr[-2000:]
    restart = lean_train_here(cli_here, run_dir, *steps)
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 21
    assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == 30

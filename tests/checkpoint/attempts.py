"""Runs of a checkpoint root through :class:`~skylift.checkpoint.session.Checkpointing` in
this process, wired as the Runtime wires it (``open``, ``resume``, ``save``, ``close``), with
a tiny model: the storage and the checkpoint bookkeeping are under test, not training. A
"kill" is a session that stops saving (its lease is released so the next attempt may start
at once; what a kill leaves in the root is the same).

Also moto's own IAM evaluation switched on for one test (:func:`iam_denied`): access denied
as a real S3 answers it, for reads or writes of chosen keys.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load
from torch import nn

from skylift.checkpoint.session import Checkpointing, TrainingObjects
from skylift.config.checkpoint import CheckpointConfig
from skylift.loop.agreement import StepAgreement
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import TrainState
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
            result = self.try_save(step)
            assert result is not None and result.committed, result and result.error

    def try_save(self, step: int):
        """One save at ``step`` (weights marking it), whatever comes of it."""
        with torch.no_grad():
            self.model.weight.fill_(float(step))
        self.state.step = step
        return self.session.save(self.state)


def run_attempt(root: str, *saves: int, **options) -> int | None:
    """An attempt that resumes, saves at ``saves`` and stops; returns the step it resumed from."""
    with Attempt(root, **options) as attempt:
        resumed = attempt.resume()
        attempt.save(*saves)
    return resumed


def weight_of(store, step: int) -> float:
    """The step number the saved weights mark (tells a re-done step from the abandoned one)."""
    return float(load(store.read_bytes(f"step-{step}/model.safetensors"))["weight"][0, 0])


def corrupt(store, step: int) -> None:
    key = f"step-{step}/model.safetensors"
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(key, bytes(data))


@contextmanager
def iam_denied(moto_server, bucket: str, monkeypatch, action: str, keys: str | list[str]) -> Iterator[None]:
    """Credentials of an IAM user that may do anything but ``action`` (``s3:GetObject``,
    ``s3:PutObject``) on ``keys`` (patterns under ``bucket``), with moto enforcing IAM."""
    import boto3
    import requests

    iam = boto3.client("iam", endpoint_url=moto_server.endpoint_url, region_name="us-east-1")
    user = f"trainer-{free_port()}"
    iam.create_user(UserName=user)
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:*", "Resource": "*"},
        {"Effect": "Deny", "Action": action,
         "Resource": [f"arn:aws:s3:::{bucket}/{key}" for key in ([keys] if isinstance(keys, str) else keys)]},
    ]}  # fmt: skip
    iam.put_user_policy(UserName=user, PolicyName="denied", PolicyDocument=json.dumps(policy))
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

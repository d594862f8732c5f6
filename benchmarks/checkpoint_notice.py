"""Spot notice -> committed checkpoint, through skylift's real path.

A loopback AWS metadata server (``tests/cloud/metadata_server.py``: IMDSv2 tokens,
``/latest/meta-data/spot/instance-action``) stands in for EC2's; skylift's
``PreemptionWatch`` polls it (``NoticeWatcher``, cloud ``aws``) and records a stop
request in a ``StepAgreement``. The loop below is the Trainer's step boundary: train
one step, ``agreement.exchange()``, save when due, and on a preemption decision
``Checkpointing.save_for_preemption`` (wait for the save in flight, then a blocking
save). The clock runs from the moment the notice is published to the moment that
call returns with the checkpoint committed.

Two scenarios per target, each on a fresh checkpoint root: ``idle`` (no save yet, none
in flight: the notice is armed ``uniform(0, arm_within_s)`` after the loop starts) and
``during_save`` (the first step boundary starts a background save, and the notice is
armed ``uniform(0, arm_within_s)`` after that, so normally while it is being written).
In ``idle`` no save has committed yet, so ``save_for_preemption`` has no estimate and
skips its does-it-fit check (it always saves); in ``during_save`` it checks.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint_targets import Target
from benchmarks.checkpoint_workload import BATCH_SIZE, Workload
from skylift.checkpoint.session import Checkpointing, TrainingObjects
from skylift.config.schema import CheckpointConfig, PreemptionConfig
from skylift.loop.agreement import StepAgreement, StopReason
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import TrainState
from skylift.train.preemption import PreemptionWatch
from tests.cloud.metadata_server import MetadataServer

__all__ = ["SCENARIOS", "measure_notice_to_commit"]

SCENARIOS = ("idle", "during_save")
NOTICE_WINDOW_S = 120.0  # what EC2 gives between the notice and the end
GIVE_UP_AFTER_S = 300.0  # no committed save this long after arming: fail loudly


@dataclass
class Arming:
    """Publishes the notice after ``delay_s`` (a timer thread); records when."""

    metadata: MetadataServer
    checkpointing: Checkpointing
    delay_s: float
    armed_at_s: float | None = None
    save_in_flight: bool | None = None
    _timer: threading.Timer | None = field(default=None, repr=False)

    def start(self) -> None:
        if self._timer is not None:
            return
        self._timer = threading.Timer(self.delay_s, self._arm)
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self) -> None:
        self.save_in_flight = self.checkpointing.manager.busy
        self.armed_at_s = time.time()
        self.metadata.arm("aws", deadline_in_s=NOTICE_WINDOW_S)


def measure_notice_to_commit(
    workload: Workload, target: Target, scenario: str, *, poll_interval_s: float, arm_within_s: float,
    rng: random.Random,
) -> dict[str, Any]:  # fmt: skip
    """One notice in ``scenario`` (see the module docstring)."""
    url, store = target.sibling(f"notice-{scenario}")
    agreement = StepAgreement()
    with tempfile.TemporaryDirectory(prefix="skylift-bench-run-") as run_dir, MetadataServer() as metadata:
        os.environ["SKYLIFT_METADATA_ENDPOINT"] = metadata.url
        checkpointing = _open_checkpointing(url, target, agreement, Path(run_dir), workload)
        watch = PreemptionWatch(PreemptionConfig(cloud="aws", poll_interval_s=poll_interval_s), agreement, local_rank=0)
        arming = Arming(metadata, checkpointing, rng.uniform(0.0, arm_within_s))
        try:
            watch.start()
            record, timeline = _train_until_stopped(workload, agreement, checkpointing, arming, scenario)
        finally:
            arming.cancel()
            watch.stop()
            checkpointing.close()
            os.environ.pop("SKYLIFT_METADATA_ENDPOINT", None)
            store.delete_prefix("")
    return _describe(scenario, arming, watch, record, timeline, poll_interval_s)


def _open_checkpointing(
    url: str, target: Target, agreement: StepAgreement, run_dir: Path, workload: Workload
) -> Checkpointing:
    config = CheckpointConfig(root=url, endpoint_url=target.endpoint_url, keep=2, async_save=True,
                              save_at_end=False, local_root=target.local_root)  # fmt: skip
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    checkpointing = Checkpointing(config, run_dir=run_dir, context=context, agreement=agreement)
    checkpointing.open()
    objects = TrainingObjects(workload.model, workload.optimizer, workload.scheduler, None)
    if checkpointing.resume(objects, _train_state(workload)) is not None:
        raise RuntimeError(f"{url} already held a checkpoint")
    return checkpointing


def _train_state(workload: Workload) -> TrainState:
    never = 10**9
    return TrainState(total_steps=never, steps_per_epoch=never, global_batch_size=BATCH_SIZE, step=workload.step)


def _train_until_stopped(
    workload: Workload, agreement: StepAgreement, checkpointing: Checkpointing, arming: Arming, scenario: str
) -> tuple[dict[str, Any], dict[str, float]]:
    """The Trainer's step boundary, until a preemption decision has been acted on."""
    state = _train_state(workload)
    if scenario == "during_save":
        agreement.request_save()  # the first boundary saves, as after a rebalance notice
    else:
        arming.start()
    while True:
        workload.train(1)
        state.step, state.samples_seen = workload.step, state.samples_seen + BATCH_SIZE
        boundary_at_s = time.time()
        decision = agreement.exchange()
        if checkpointing.due(state, decision):
            checkpointing.save(state)
            arming.start()
        if decision.stop_code == StopReason.PREEMPTED:
            record = checkpointing.save_for_preemption(state, decision)
            return record, {"boundary_at_s": boundary_at_s, "committed_at_s": time.time()}
        if arming.armed_at_s is not None and time.time() - arming.armed_at_s > GIVE_UP_AFTER_S:
            raise RuntimeError("the spot notice never stopped the loop")


def _describe(
    scenario: str, arming: Arming, watch: PreemptionWatch, record: dict[str, Any], timeline: dict[str, float],
    poll_interval_s: float,
) -> dict[str, Any]:  # fmt: skip
    armed_at_s, notice = arming.armed_at_s, watch.notice
    if armed_at_s is None or notice is None or not record["saved"]:
        raise RuntimeError(f"notice run {scenario}: armed {armed_at_s}, notice {notice}, record {record}")
    finished_at_s = timeline["committed_at_s"]
    committed_at_s = finished_at_s
    if "notice_to_upload_s" in record:
        # With a local copy the checkpoint exists at the local commit; the upload
        # follows. skylift's record counts both from detection (notice.received_at_s).
        committed_at_s = notice.received_at_s + record["notice_to_commit_s"]
        if record["notice_to_upload_s"] is None:
            raise RuntimeError(f"notice run {scenario}: the upload did not commit: {record}")
    return {
        "scenario": scenario,
        "poll_interval_s": poll_interval_s,
        "arm_delay_s": round(arming.delay_s, 3),
        "save_in_flight_at_notice": arming.save_in_flight,
        "notice_to_commit_s": round(committed_at_s - armed_at_s, 3),
        "notice_to_upload_s": round(finished_at_s - armed_at_s, 3) if "notice_to_upload_s" in record else None,
        "notice_to_detect_s": round(notice.received_at_s - armed_at_s, 3),
        "detect_to_step_boundary_s": round(timeline["boundary_at_s"] - notice.received_at_s, 3),
        "step_boundary_to_commit_s": round(committed_at_s - timeline["boundary_at_s"], 3),
        "skylift_record": {key: record.get(key) for key in ("step", "saved", "checkpoint_step", "notice_to_commit_s",
                                                            "notice_to_upload_s")},
    }

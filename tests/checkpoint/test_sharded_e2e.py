"""Sharded checkpoints end to end: ``skylift run --nproc 2 --set distributed.strategy=fsdp``.

Real ``python -m skylift run`` processes under torchrun over gloo, as the DDP tests in
test_crash_resume.py and test_preemption.py run them, with FSDP2 sharding the model:
SIGKILLs at three points (a rank killed before the commit, a rank killed mid-write, both
killed right after the manifest), a spot notice from the loopback metadata server, and a
resume on one process of a checkpoint two wrote. Every save is in the sharded layout.

Every run here is test_preemption.py's command (80 steps), so one uninterrupted two-process
run is the reference of all three tests; it saves every 7 steps (the kill points' cadence),
the noticed run every 25: a save changes nothing a resume restores, so the two equal bit
for bit. The two-process runs stay torchrun (gloo process groups); the one-process resume
runs in this process (``_run_here``): its start is not under test.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from skylift.checkpoint.consolidate import full_model_state
from skylift.checkpoint.manifest import committed_steps, read_manifest, read_verified
from skylift.storage import open_store
from tests.checkpoint.runs import assert_same_run, losses_by_step, records, summary
from tests.checkpoint.test_preemption import (
    ARM_AFTER_STEP,
    MAX_STEPS,
    ReferenceRun,
    _environment,
    _latest_train_step,
    _records,
    _run_here,
    assert_resumes_exactly,
    running,
    train_to_end,
)
from tests.cloud.metadata_server import MetadataServer

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

FSDP = "distributed.strategy=fsdp"
EVERY_7 = (FSDP, "checkpoint.every_steps=7", "checkpoint.keep=12")
"""The reference's and the killed runs' overrides: saves at 7, 14, ..., 77 and the final 80, all
12 kept, so the reference's step-28 checkpoint is there for the one-process resume."""
KILLS = [
    ("after_payload:step=14:rank=1", 7),   # rank 1 wrote its shards, died before the commit: step 14 torn
    ("during_payload:step=28:rank=0", 21),  # rank 0 died between its files: step 28 torn
    ("after_manifest:step=42", 42),          # both died right after the commit, before LATEST: step 42 stands
]
"""(kill point, the step the next attempt must resume from)."""


@pytest.fixture(scope="module")
def reference_fsdp(tmp_path_factory):
    """The uninterrupted two-process FSDP run every test here compares with, started at once."""
    background = ReferenceRun(tmp_path_factory.mktemp("reference-fsdp") / "run", nproc=2, overrides=EVERY_7)
    try:
        yield background
    finally:
        background.run.kill()


def _assert_sharded_commits(checkpoints, world_size: int) -> None:
    store = open_store(str(checkpoints))
    for step in committed_steps(store):
        manifest = read_manifest(store, step)
        assert (manifest.layout, manifest.world_size) == ("sharded", world_size), step
        read_verified(store, step, manifest)  # every rank's shards against their sha256


def test_sigkill_at_three_points_then_every_loss_and_the_final_weights_equal_the_uninterrupted_run(
        reference_fsdp, tmp_path):
    run_dir = tmp_path / "run"
    for point, resumes_from in KILLS:
        with running(run_dir, nproc=2, env={**_environment(), "SKYLIFT_FAULT_INJECTION": point},
                     overrides=EVERY_7) as killed:
            assert killed.wait() != 0, f"{point} did not kill the run:\n{killed.stderr[-2000:]}"
        assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == resumes_from, point
    train_to_end(run_dir, nproc=2, env=_environment(), overrides=EVERY_7)
    assert summary(run_dir)["resumed_from_step"] == KILLS[-1][1]
    assert_same_run(run_dir, reference_fsdp.get().run_dir)
    _assert_sharded_commits(run_dir / "checkpoints", world_size=2)
    assert all(record["committed"] and record["stall_s"] > 0 for record in records(run_dir, "checkpoint"))
    # The newest checkpoint consolidates, in this process, to the final weights the run wrote.
    step, weights = full_model_state(str(run_dir / "checkpoints"))
    final_weights = load_file(run_dir / "model.safetensors")
    assert step == MAX_STEPS and weights.keys() == final_weights.keys()
    for name, tensor in final_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_a_two_rank_checkpoint_resumes_in_one_process_at_the_next_sample(reference_fsdp, tmp_path):
    # The uninterrupted two-rank run's step-28 checkpoint, alone in a fresh root, continued to
    # the end in one process (no sharding there: DCP reshards the two ranks' chunks into whole
    # tensors). On two ranks its continuation is the reference's own step 29: the SIGKILL test
    # above shows a resume of it equals the uninterrupted run bit for bit.
    reference = reference_fsdp.get()
    one = tmp_path / "one"
    shutil.copytree(reference.run_dir / "checkpoints" / "step-28", one / "checkpoints" / "step-28")
    resumed = _run_here(one, env=_environment())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = summary(one)
    assert (done["resumed_from_step"], done["steps"]) == (28, MAX_STEPS)
    # The next sample on: no step redone, none skipped.
    assert sorted(losses_by_step(one)) == list(range(29, MAX_STEPS + 1))
    # Step 29's loss comes from the restored weights on the same 64 samples (the global
    # batch order does not depend on the world size); only the fp32 mean's summation
    # differs (two 32-sample means averaged, or one 64-sample mean, and the kernels'
    # blocking per batch size): a relative error under 64 x 2^-24 ~ 4e-6, checked at 1e-5.
    assert losses_by_step(one)[29] == pytest.approx(reference.losses[29], rel=1e-5)


def test_spot_notice_commits_a_sharded_checkpoint_before_the_deadline_exits_143_and_resumes(
        reference_fsdp, tmp_path):
    from skylift.errors import EXIT_REQUEUE

    run_dir = tmp_path / "run"
    with MetadataServer() as server, running(run_dir, nproc=2, env=_environment("aws", server.url),
                                              overrides=(FSDP,)) as run:
        run.wait_for_step(ARM_AFTER_STEP)
        deadline_s = server.arm("aws", deadline_in_s=90)
        assert run.wait() == EXIT_REQUEUE, run.explain()
    (record,) = _records(run_dir, "preemption")
    stopped_at = _latest_train_step(run_dir)
    assert record["saved"] and record["checkpoint_step"] == stopped_at > ARM_AFTER_STEP - 1, record
    assert record["notice_to_commit_s"] < record["seconds_left_at_notice"], record
    manifest = read_manifest(open_store(str(run_dir / "checkpoints")), stopped_at)
    assert (manifest.layout, manifest.world_size) == ("sharded", 2)
    assert manifest.created_at < deadline_s
    _assert_sharded_commits(run_dir / "checkpoints", world_size=2)
    assert_resumes_exactly(run_dir, stopped_at, reference_fsdp, nproc=2, env=_environment(), overrides=(FSDP,))

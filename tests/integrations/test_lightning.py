"""Lightning with skylift's callback, in this process: a real ``lightning.Trainer`` fitting a
small MLP on generated data. A SIGTERM sent from inside the run stands in for a spot
notice; the end-to-end runs under ``skylift launch --nproc 2`` are in ``test_launch.py``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning.pytorch as pl

from examples.integrations import lightning_job
from skylift.checkpoint.manifest import MANIFEST
from skylift.config.load import load_config
from skylift.errors import EXIT_REQUEUE
from skylift.integrations.checkpoints import verify_folder
from skylift.integrations.lightning import CHECKPOINT_FILE, SkyliftCallback, resume_checkpoint
from tests.integrations.records import losses_by_step, records

LEAN = ("preemption.cloud=off", "monitor.tensorboard=false", "monitor.report=false", "monitor.system_interval_s=0",
        "monitor.log_every_steps=1", "checkpoint.every_minutes=null")


class SigtermAt(pl.Callback):
    """Sends this process SIGTERM at the end of ``step``, before skylift's callback sees it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_index):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _callback(run_dir: Path, *overrides: str) -> SkyliftCallback:
    return SkyliftCallback(load_config(None, [*LEAN, f"run_dir={run_dir}", *overrides]), exit_on_stop=False)


def test_sigterm_saves_a_complete_checkpoint_and_resume_skips_a_torn_one(tmp_path):
    run_dir = tmp_path / "run"
    callback = _callback(run_dir, "checkpoint.every_steps=2")
    trainer = lightning_job.trainer([SigtermAt(5), callback])
    trainer.fit(lightning_job.Classifier(), lightning_job.loader(), ckpt_path=resume_checkpoint(trainer))

    assert (callback.exit_code, callback.stopped) == (EXIT_REQUEUE, "preemption notice")
    assert trainer.global_step == 5 and trainer.should_stop
    checkpoints = run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-2", "step-4", "step-5"]
    assert set(verify_folder(checkpoints / "step-5", 5).files) == {CHECKPOINT_FILE}
    [preemption] = records(run_dir, "preemption")
    assert preemption["saved"] is True and preemption["checkpoint_step"] == 5, preemption
    assert 0 < preemption["notice_to_commit_s"] < preemption["seconds_left_at_notice"], preemption
    train = records(run_dir, "train")
    assert [record["step"] for record in train] == [1, 2, 3, 4, 5]
    assert all(record["train_loss"] == record["loss"] for record in train)  # callback_metrics, one rank

    assert resume_checkpoint(trainer) == str(checkpoints / "step-5" / CHECKPOINT_FILE)
    (checkpoints / "step-5" / MANIFEST).unlink()  # killed between Lightning's write and the seal
    with open(checkpoints / "step-4" / CHECKPOINT_FILE, "r+b") as handle:
        handle.truncate(64)
    assert resume_checkpoint(callback) == str(checkpoints / "step-2" / CHECKPOINT_FILE)


def test_a_resumed_fit_continues_the_global_step_and_keeps_the_newest_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    first = _callback(run_dir, "checkpoint.every_steps=4", "checkpoint.keep=2")
    trainer = lightning_job.trainer([SigtermAt(10), first])
    trainer.fit(lightning_job.Classifier(), lightning_job.loader())
    assert first.exit_code == EXIT_REQUEUE

    second = _callback(run_dir, "checkpoint.every_steps=4", "checkpoint.keep=2")
    trainer = lightning_job.trainer([second])
    resumed_from = resume_checkpoint(trainer)
    assert resumed_from == str(run_dir / "checkpoints" / "step-10" / CHECKPOINT_FILE)
    trainer.fit(lightning_job.Classifier(), lightning_job.loader(), ckpt_path=resumed_from)

    assert second.exit_code == 0 and trainer.global_step == lightning_job.MAX_STEPS
    starts = records(run_dir, "run_start")
    assert [(start["attempt"], start["resumed_from_step"], start["step"]) for start in starts] == [
        (1, None, 0), (2, 10, 10)]
    assert sorted(losses_by_step(run_dir)) == list(range(1, lightning_job.MAX_STEPS + 1))
    kept = sorted(path.name for path in (run_dir / "checkpoints").iterdir())
    assert kept == ["step-20", f"step-{lightning_job.MAX_STEPS}"]  # keep=2; the final save at the end

"""The Hugging Face Trainer with skylift's callback, in this process: a real ``Trainer``
fine-tuning a tiny BERT built from its config class on generated data.

A SIGTERM sent from inside the run (a callback listed before skylift's) stands in for
a spot notice: both reach the same agreed stop. The end-to-end runs with a cloud's
notice under ``skylift launch --nproc 2`` are in ``test_launch.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from examples.integrations import hf_job
from skylift.checkpoint.manifest import MANIFEST
from skylift.config.load import load_config
from skylift.errors import EXIT_REQUEUE, SkyliftConfigError
from skylift.integrations.checkpoints import verify_folder
from skylift.integrations.transformers import SkyliftCallback, resume_checkpoint
from tests.integrations.records import losses_by_step, records

LEAN = ("preemption.cloud=off", "monitor.tensorboard=false", "monitor.report=false", "monitor.system_interval_s=0")
"""Signals only (no metadata service to poll here), and none of the extras these tests do not read."""


class SigtermAt(TrainerCallback):
    """Sends this process SIGTERM at the end of ``step``, before skylift's callback sees it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _config(run_dir: Path, *overrides: str):
    return load_config(None, [*LEAN, f"run_dir={run_dir}", *overrides])


def _preempted_run(output_dir: Path, run_dir: Path, *, at_step: int, save_steps: int):
    callback = SkyliftCallback(_config(run_dir), exit_on_stop=False)
    trainer = hf_job.trainer(output_dir, callbacks=[SigtermAt(at_step), callback], save_steps=save_steps)
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer))
    return trainer, callback


def test_sigterm_stops_at_that_step_with_a_complete_checkpoint_and_a_torn_one_is_skipped(tmp_path):
    output_dir, run_dir = tmp_path / "out", tmp_path / "run"
    trainer, callback = _preempted_run(output_dir, run_dir, at_step=5, save_steps=2)

    assert (callback.exit_code, callback.stopped) == (EXIT_REQUEUE, "preemption notice")
    assert trainer.state.global_step == 5  # one process: the stop is agreed at the step it was heard
    manifest = verify_folder(output_dir / "checkpoint-5", 5)
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(
        manifest.files)
    [preemption] = records(run_dir, "preemption")
    assert preemption["saved"] is True and preemption["checkpoint_step"] == 5, preemption
    assert 0 < preemption["notice_to_commit_s"] < preemption["seconds_left_at_notice"], preemption
    commits = {record["step"]: record["committed"] for record in records(run_dir, "checkpoint")}
    assert commits == {2: True, 4: True, 5: True}
    assert sorted(losses_by_step(run_dir)) == [1, 2, 3, 4, 5]  # the Trainer's logs, one per step
    [run_end] = records(run_dir, "run_end")
    assert (run_end["step"], run_end["stopped_early"]) == (5, "preemption notice")

    assert resume_checkpoint(trainer) == str(output_dir / "checkpoint-5")
    # A save cut short: the Trainer's files are there, the manifest is not (or no longer matches).
    (output_dir / "checkpoint-5" / MANIFEST).unlink()
    with open(output_dir / "checkpoint-4" / "optimizer.pt", "r+b") as handle:
        handle.truncate(64)
    assert resume_checkpoint(output_dir) == str(output_dir / "checkpoint-2")


def test_save_total_limit_of_one_is_refused_naming_the_field(tmp_path):
    arguments = TrainingArguments(output_dir=str(tmp_path), save_total_limit=1, use_cpu=True, report_to=[])
    with pytest.raises(SkyliftConfigError, match="save_total_limit=1") as refusal:
        SkyliftCallback(_config(tmp_path / "run")).on_train_begin(arguments, TrainerState(), TrainerControl())
    assert "save_total_limit=2 or more" in str(refusal.value)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An uninterrupted run of the same job: (output_dir, run_dir)."""
    base = tmp_path_factory.mktemp("reference")
    callback = SkyliftCallback(_config(base / "run"), exit_on_stop=False)
    hf_job.trainer(base / "out", callbacks=[callback]).train()
    assert callback.exit_code == 0
    return base / "out", base / "run"


@pytest.mark.slow
def test_a_resume_on_a_fresh_disk_from_s3_equals_the_uninterrupted_run(tmp_path, reference, s3_bucket, moto_server,
                                                                        monkeypatch, cli_here):
    monkeypatch.setenv("SKYLIFT_CHECKPOINT_ROOT", f"s3://{s3_bucket}/hf-job")
    monkeypatch.setenv("SKYLIFT_S3_ENDPOINT_URL", moto_server.endpoint_url)
    output_dir, run_dir = tmp_path / "machine-1", tmp_path / "run"
    _preempted_run(output_dir, run_dir, at_step=11, save_steps=hf_job.SAVE_STEPS)
    [upload] = [record for record in records(run_dir, "checkpoint") if record["step"] == 11]
    assert upload["uploaded"] is True, upload
    shutil.rmtree(output_dir)  # the spot machine is gone with its disk

    fresh = tmp_path / "machine-2"
    callback = SkyliftCallback(_config(run_dir, "monitor.report=true"), exit_on_stop=False)
    trainer = hf_job.trainer(fresh, callbacks=[callback])
    resumed_from = resume_checkpoint(trainer)
    assert resumed_from == str(fresh / "checkpoint-11")
    trainer.train(resume_from_checkpoint=resumed_from)
    assert callback.exit_code == 0 and trainer.state.global_step == hf_job.MAX_STEPS

    starts = records(run_dir, "run_start")
    assert [(start["attempt"], start["resumed_from_step"]) for start in starts] == [(1, None), (2, 11)]
    # The Trainer's own resume is exact here: it restores model, optimizer, scheduler and
    # every RNG, and skips the epoch's consumed batches of its seeded sampler; fp32 on the
    # CPU runs the same arithmetic, so the losses and weights are bitwise equal.
    reference_out, reference_run = reference
    assert losses_by_step(run_dir) == losses_by_step(reference_run)
    final, expected = (load_file(folder / f"checkpoint-{hf_job.MAX_STEPS}" / "model.safetensors")
                       for folder in (fresh, reference_out))
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], expected[name]) for name in expected)

    report = cli_here("report", str(run_dir))
    assert report.returncode == 0, report.stderr
    page = (run_dir / "report" / "index.html").read_text()
    assert 'id="loss"' in page and "preempt" in page.lower()

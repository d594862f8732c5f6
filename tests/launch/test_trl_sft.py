"""TRL's own command line, unchanged, under ``skylift launch --nproc 2``.

``trl sft`` fine-tunes a tiny local Llama (:func:`skylift.recipes.tiny_lm.write_tiny_lm`,
no download) on a tiny local JSONL dataset: an AWS spot notice from the loopback
metadata server -> a complete checkpoint -> exit 143 -> the same command resumes from it
and ends where an uninterrupted run ends, with the same losses.

``trl sft`` re-launches its training script through ``accelerate launch``; inside a
skylift worker that runs in the worker (:mod:`skylift.integrations.nested_launch`), where
the attach hook gives the ``SFTTrainer`` skylift's callback and the resume. The command
names ``--use_cpu`` because this is a CPU machine: without it the Trainer forms no group
on the CPU and each worker trains alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from skylift.errors import EXIT_REQUEUE
from skylift.integrations.checkpoints import verify_folder
from skylift.recipes.tiny_lm import tiny_corpus, write_corpus, write_tiny_lm
from tests.cloud.metadata_server import MetadataServer
from tests.integrations.records import losses_by_step, records

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

MAX_STEPS = 120
SAVE_STEPS = 10
"""The Trainer's own cadence: the notice is armed once the first of these checkpoints is sealed."""
RUN_TIMEOUT_S = 400.0
DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens


def _environment(tmp_path: Path, endpoint: str = DEAD_ENDPOINT) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
    env.update(PYTHONUNBUFFERED="1", SKYLIFT_CLOUD="aws", SKYLIFT_METADATA_ENDPOINT=endpoint,
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"))
    return env


def _command(tmp_path: Path, output_dir: Path, checkpoint_root: Path) -> list[str]:
    """The user's command, as they would type it after ``skylift launch ... --``."""
    trl_sft = ["trl", "sft", "--model_name_or_path", str(tmp_path / "model"), "--dataset_name", str(tmp_path / "data"),
               "--output_dir", str(output_dir), "--max_steps", str(MAX_STEPS), "--per_device_train_batch_size", "4",
               "--learning_rate", "1e-3", "--logging_steps", "1", "--save_steps", str(SAVE_STEPS), "--max_length", "32",
               "--seed", "0", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true"]
    return [sys.executable, "-m", "skylift", "launch", "--nproc", "2", "--no-doctor",
            "--checkpoint-root", str(checkpoint_root), "--", *trl_sft]


def _launch(tmp_path: Path, output_dir: Path, root: Path, env: dict[str, str], logs: Path) -> subprocess.Popen:
    logs.parent.mkdir(parents=True, exist_ok=True)
    with logs.open("w") as output:
        return subprocess.Popen(_command(tmp_path, output_dir, root), cwd=tmp_path, env=env, stdout=output,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _kill_family(process: subprocess.Popen) -> None:
    try:
        family = psutil.Process(process.pid).children(recursive=True)
        os.killpg(process.pid, signal.SIGKILL)
    except (psutil.Error, ProcessLookupError):
        family = []
    for child in family:
        with contextlib.suppress(psutil.Error):
            child.kill()
    process.wait(30)


def _finish(process: subprocess.Popen, logs: Path) -> int:
    try:
        return process.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"no exit within {RUN_TIMEOUT_S} s:\n{logs.read_text()[-4000:]}") from None
    finally:
        _kill_family(process)


def _trainer_losses(output_dir: Path) -> dict[int, float]:
    state = json.loads((output_dir / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def test_trl_sft_unchanged_notice_checkpoint_exit_143_and_the_same_command_resumes(tmp_path):
    write_tiny_lm(tmp_path / "model")
    write_corpus(tmp_path / "data" / "train.jsonl", [row for row in tiny_corpus(600) if "text" in row])  # 200 rows
    output_dir, root = tmp_path / "out", tmp_path / "root"

    # 1. Preempted: the notice is armed once the Trainer's first checkpoint is sealed.
    logs = tmp_path / "logs" / "preempted.log"
    with MetadataServer() as server:
        process = _launch(tmp_path, output_dir, root, _environment(tmp_path, server.url), logs)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (output_dir / f"checkpoint-{SAVE_STEPS}" / "manifest.json").exists():
            if process.poll() is not None or time.monotonic() > deadline:
                _kill_family(process)
                raise AssertionError(f"no sealed checkpoint-{SAVE_STEPS}:\n{logs.read_text()[-4000:]}")
            time.sleep(0.1)
        deadline_s = server.arm("aws", deadline_in_s=90)
        code = _finish(process, logs)
    log = logs.read_text()
    assert code == EXIT_REQUEUE, log[-4000:]
    assert "skylift: accelerate launch inside a skylift worker: sft.py runs in each of the 2 worker(s)" in log
    assert "skylift: attached SkyliftCallback to SFTTrainer; no complete checkpoint: fresh start" in log
    [preemption] = records(output_dir, "preemption")
    stop_step = preemption["checkpoint_step"]
    assert preemption["saved"] and SAVE_STEPS < stop_step < MAX_STEPS, preemption
    manifest = verify_folder(output_dir / f"checkpoint-{stop_step}", stop_step)
    assert manifest.created_at < deadline_s
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "model.safetensors"} <= set(manifest.files)
    assert (root / f"checkpoint-{stop_step}").is_dir()  # mirrored to the checkpoint root

    # 2. The same command again: resumes from the notice's checkpoint, ends at MAX_STEPS.
    logs = tmp_path / "logs" / "resumed.log"
    code = _finish(_launch(tmp_path, output_dir, root, _environment(tmp_path), logs), logs)
    log = logs.read_text()
    assert code == 0, log[-4000:]
    assert f"resuming from {output_dir}/checkpoint-{stop_step}" in log or \
        f"resuming from out/checkpoint-{stop_step}" in log, log[-4000:]
    starts = records(output_dir, "run_start")
    assert [(start["attempt"], start["resumed_from_step"], start["world_size"]) for start in starts] == [
        (1, None, 2), (2, stop_step, 2)]
    assert sorted(losses_by_step(output_dir)) == list(range(1, MAX_STEPS + 1))

    # 3. Uninterrupted, for the losses.
    reference_dir, reference_root = tmp_path / "reference", tmp_path / "reference-root"
    logs = tmp_path / "logs" / "reference.log"
    assert _finish(_launch(tmp_path, reference_dir, reference_root, _environment(tmp_path), logs), logs) == 0
    resumed, reference = _trainer_losses(output_dir), _trainer_losses(reference_dir)
    assert sorted(resumed) == sorted(reference) == list(range(1, MAX_STEPS + 1))
    # The Trainer's resume is exact here (same world size, seeded sampler, RNG states per
    # rank, fp32 on the CPU, no dropout in the tiny Llama): equal bit for bit, before and after the stop.
    assert resumed == reference
    assert losses_by_step(output_dir) == losses_by_step(reference_dir)

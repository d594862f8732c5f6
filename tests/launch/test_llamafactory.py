"""LLaMA-Factory's own command line, unchanged, under ``skylift launch --nproc 1``.

``llamafactory-cli train sft.yaml`` fully fine-tunes a tiny local Llama
(:func:`skylift.recipes.tiny_lm.write_tiny_lm`, no download) on a tiny local Alpaca-style
dataset: an AWS spot notice from the loopback metadata server -> a complete checkpoint
-> exit 143 -> the same command resumes from it and ends where an uninterrupted run
ends, with the same losses.

On the CPU ``llamafactory-cli train`` runs its workflow in the process (it re-launches
through torchrun only with several GPUs or ``FORCE_TORCHRUN``), where the attach hook
gives its ``CustomSeq2SeqTrainer`` skylift's callback. LLaMA-Factory chooses its own
resume (transformers' ``get_last_checkpoint``: the highest ``checkpoint-N``), which the
attach leaves as it is.

LLaMA-Factory 0.9.5 pins transformers <= 5.6.0 and trl <= 0.24.0, older than this
project's, so it lives in a venv of its own: ``make test-llamafactory`` builds
``.venv-llamafactory`` (requirements/test-llamafactory.txt) and runs this file there.
Elsewhere it is skipped.

One process, not two: on the CPU, LLaMA-Factory trains under ``--nproc 2`` (a group of
2, sealed checkpoints, the notice and 143 as with one), but its pinned transformers
(5.6.0) cannot resume that run: with more than one process it loads ``optimizer.pt``
with ``map_location=args.device``, which is ``cpu:0`` on the CPU, and torch 2.14.1
refuses it (``RuntimeError: don't know how to restore data location of
torch.storage.UntypedStorage (tagged with cpu:0)``). On GPUs the location is ``cuda:N``;
the project's own transformers (5.25) loads it on the CPU too (``test_trl_sft.py``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from skylift.errors import EXIT_REQUEUE
from skylift.integrations.checkpoints import verify_folder
from skylift.recipes.tiny_lm import tiny_corpus, write_tiny_lm
from tests.cloud.metadata_server import MetadataServer
from tests.integrations.records import losses_by_step, records
from tests.launch.test_trl_sft import RUN_TIMEOUT_S, _environment, _finish, _kill_family

pytestmark = [
    pytest.mark.slow, pytest.mark.multiprocess,
    pytest.mark.skipif(importlib.util.find_spec("llamafactory") is None,
                       reason="LLaMA-Factory is not installed here: `make test-llamafactory` runs this test in "
                       ".venv-llamafactory (it pins transformers<=5.6.0 and trl<=0.24.0, older than the project's)"),
]

NPROC = 1
"""See the module's docstring: transformers 5.6.0 cannot resume a CPU run of 2 processes."""
MAX_STEPS = 60
SAVE_STEPS = 10
"""The Trainer's own cadence: the notice is armed once the first of these checkpoints is sealed."""


def _write_job(tmp_path: Path, output_dir: Path) -> Path:
    """The model, the dataset with its ``dataset_info.json``, and the YAML a user would write."""
    write_tiny_lm(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    rows = [{"instruction": row["prompt"], "input": "", "output": row["completion"].strip()}
            for row in tiny_corpus(600) if "prompt" in row]  # 200 rows
    (data / "train.json").write_text(json.dumps(rows))
    (data / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "train.json"}}))
    settings = {
        "model_name_or_path": str(tmp_path / "model"), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "tiny", "dataset_dir": str(data), "template": "empty", "cutoff_len": 32,
        "preprocessing_num_workers": 1, "output_dir": str(output_dir), "logging_steps": 1,
        "save_steps": SAVE_STEPS, "max_steps": MAX_STEPS, "per_device_train_batch_size": 4, "learning_rate": 1.0e-3,
        "report_to": "none", "use_cpu": True, "seed": 0, "disable_tqdm": True,
    }
    job = tmp_path / f"{output_dir.name}.yaml"
    job.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in settings.items()))
    return job


def _launch(tmp_path: Path, job: Path, env: dict[str, str], logs: Path):
    import subprocess
    import sys

    command = [sys.executable, "-m", "skylift", "launch", "--nproc", str(NPROC), "--no-doctor", "--",
               "llamafactory-cli", "train", str(job)]
    logs.parent.mkdir(parents=True, exist_ok=True)
    with logs.open("w") as output:
        return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=output, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _trainer_losses(output_dir: Path) -> dict[int, float]:
    state = json.loads((output_dir / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def test_llamafactory_cli_unchanged_notice_checkpoint_exit_143_and_the_same_command_resumes(tmp_path):
    import time

    output_dir = tmp_path / "out"
    job = _write_job(tmp_path, output_dir)

    # 1. Preempted: the notice is armed once the Trainer's first checkpoint is sealed.
    logs = tmp_path / "logs" / "preempted.log"
    with MetadataServer() as server:
        process = _launch(tmp_path, job, _environment(tmp_path, server.url), logs)
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
    assert "skylift: attached SkyliftCallback to CustomSeq2SeqTrainer; no complete checkpoint: fresh start" in log
    [preemption] = records(output_dir, "preemption")
    stop_step = preemption["checkpoint_step"]
    assert preemption["saved"] and SAVE_STEPS < stop_step < MAX_STEPS, preemption
    manifest = verify_folder(output_dir / f"checkpoint-{stop_step}", stop_step)
    assert manifest.created_at < deadline_s
    assert {"rng_state.pth", "optimizer.pt", "model.safetensors"} <= set(manifest.files)

    # 2. The same command again: LLaMA-Factory resumes from the notice's checkpoint, ends at MAX_STEPS.
    logs = tmp_path / "logs" / "resumed.log"
    code = _finish(_launch(tmp_path, job, _environment(tmp_path), logs), logs)
    log = logs.read_text()
    assert code == 0, log[-4000:]
    assert (f"the program's own resume_from_checkpoint='{output_dir}/checkpoint-{stop_step}' stays" in log), log[-4000:]
    starts = records(output_dir, "run_start")
    assert [(start["attempt"], start["resumed_from_step"], start["world_size"]) for start in starts] == [
        (1, None, NPROC), (2, stop_step, NPROC)]
    assert sorted(losses_by_step(output_dir)) == list(range(1, MAX_STEPS + 1))

    # 3. Uninterrupted, for the losses: the resume is exact (fp32 on the CPU, seeded, the RNG state restored).
    reference_dir = tmp_path / "reference"
    logs = tmp_path / "logs" / "reference.log"
    reference_job = _write_job(tmp_path, reference_dir)
    assert _finish(_launch(tmp_path, reference_job, _environment(tmp_path), logs), logs) == 0
    resumed, reference = _trainer_losses(output_dir), _trainer_losses(reference_dir)
    assert sorted(resumed) == sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert resumed == reference
    assert losses_by_step(output_dir) == losses_by_step(reference_dir)

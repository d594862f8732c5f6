"""The frameworks' own ways of losing a job, refused or repaired by skylift's callbacks:
a launch whose framework did not form the process group it was given, a finished
Trainer job run again, Lightning's own ModelCheckpoint files, the loss the Trainer logs
on several processes, the run records, and the run lease.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skylift.integrations.run import ProcessGroupNotFormedError, check_process_group

PROGRAMS = Path(__file__).parent / "programs"


def _environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # the guard stays
    # A dead loopback endpoint: no metadata service is polled off this machine.
    env.update(PYTHONUNBUFFERED="1", SKYLIFT_CLOUD="aws", SKYLIFT_METADATA_ENDPOINT="http://127.0.0.1:9")
    return env


def _launch(cwd: Path, nproc: int, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "skylift", "launch", "--nproc", str(nproc), "--no-doctor", "--", "python", *command],
        cwd=cwd, env=_environment(), capture_output=True, text=True, timeout=300, check=False,
    )


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("skylift: error:")]


# -- a process group the framework did not form --------------------------------------------


def test_a_framework_world_of_one_under_two_launched_processes_is_refused():
    with pytest.raises(ProcessGroupNotFormedError, match=r"2 processes were launched \(WORLD_SIZE=2\) but Lightning") as refusal:
        check_process_group("Lightning", 1, fix="Pass devices=2.", environ={"WORLD_SIZE": "2"})
    assert "\n" not in str(refusal.value)
    assert str(refusal.value).endswith("2 copies of the job would train side by side into one run folder. Pass devices=2.")
    check_process_group("Lightning", 2, fix="-", environ={"WORLD_SIZE": "2"})  # formed: nothing to say
    check_process_group("Lightning", 1, fix="-", environ={})  # not launched by torchrun


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_trainer_on_the_cpu_without_use_cpu_under_two_processes_is_refused_before_a_step(tmp_path):
    result = _launch(tmp_path, 2, str(PROGRAMS / "unjoined_job.py"), "hf", "out")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    [line] = _error_lines(result)  # rank 0's line, not one per copy
    assert "2 processes were launched (WORLD_SIZE=2) but the Hugging Face Trainer runs in a process group of 1" in line
    assert "TrainingArguments(use_cpu=True" in line
    assert "trained" not in result.stdout.splitlines()
    assert not list((tmp_path / "out").glob("checkpoint-*")) and not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_lightning_with_devices_auto_under_two_processes_is_refused_before_a_step(tmp_path):
    result = _launch(tmp_path, 2, str(PROGRAMS / "unjoined_job.py"), "lightning")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    [line] = _error_lines(result) or [output[-4000:]]
    assert "but the Lightning Trainer runs in a process group of 1" in line
    assert 'Pass Trainer(devices=2, strategy="ddp")' in line
    assert "trained" not in result.stdout.splitlines()
    assert not (tmp_path / "runs" / "default" / "metrics.jsonl").exists()


# -- a finished Trainer job run again ------------------------------------------------------


@pytest.mark.slow
def test_rerunning_a_finished_trainer_job_trains_nothing_writes_nothing_and_says_so(tmp_path, capfd):
    from safetensors.torch import load_file

    from examples.integrations import hf_job
    from skylift.config.load import load_config
    from skylift.integrations.checkpoints import verify_folder
    from skylift.integrations.transformers import SkyliftCallback, resume_checkpoint
    from tests.integrations.records import records

    config = load_config(None, ["preemption.cloud=off", "monitor.tensorboard=false", "monitor.report=false",
                                "monitor.system_interval_s=0", f"run_dir={tmp_path / 'run'}"])
    output_dir = tmp_path / "out"
    first = hf_job.trainer(output_dir, callbacks=[SkyliftCallback(config, exit_on_stop=False)], max_steps=6,
                           save_steps=4)
    first.train()
    final = verify_folder(output_dir / "checkpoint-6", 6)  # mid-epoch: 32 batches an epoch
    capfd.readouterr()

    callback = SkyliftCallback(config, exit_on_stop=False)
    again = hf_job.trainer(output_dir, callbacks=[callback], max_steps=6, save_steps=4)
    again.train(resume_from_checkpoint=resume_checkpoint(again))

    said = capfd.readouterr().err
    assert "skylift: nothing to train: this job finished (its newest complete checkpoint is at step 6, max_steps 6)" in said
    assert callback.exit_code == 0 and again.state.global_step == 6
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert verify_folder(output_dir / "checkpoint-6", 6) == final  # not written again
    saved = load_file(output_dir / "checkpoint-6" / "model.safetensors")
    weights = again.model.state_dict()
    assert all(weights[name].equal(saved[name]) for name in saved)  # what save_model() would write: the final model
    [start] = records(tmp_path / "run", "run_start")
    # As the Trainer ran it: 8 samples a device a step (skylift's default would say 64 / 1).
    assert (start["micro_batch_size"], start["accumulation_steps"], start["data_num_workers"]) == (8, 1, 0)
    _assert_config_describes("Hugging Face Trainer", tmp_path / "run", "per_device_batch_size: 8", "max_steps: 6")


# -- Lightning's own ModelCheckpoint files ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_kill_9_of_a_lightning_job_resumes_from_the_file_its_model_checkpoint_wrote(tmp_path):
    import signal
    import time

    from skylift.integrations.checkpoints import verify_folder
    from tests.integrations.records import records

    script = str(PROGRAMS / "lightning_model_checkpoint_job.py")
    with (tmp_path / "first.log").open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "skylift", "launch", "--nproc", "1", "--no-doctor", "--", "python", script, "12",
             "6"], cwd=tmp_path, env=_environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "hanging").exists():
            if process.poll() is not None or time.monotonic() >= deadline:
                raise AssertionError((tmp_path / "first.log").read_text()[-4000:])
            time.sleep(0.1)
        # A second job on the same folder while the first one lives: refused in one line, before a step.
        second = _launch(tmp_path, 1, script, "12")
        assert second.returncode != 0, (second.stdout + second.stderr)[-4000:]
        [refusal] = _error_lines(second) or [(second.stdout + second.stderr)[-4000:]]
        assert "run owned by job lightning-" in refusal and "another job is writing these checkpoints" in refusal
        assert "Traceback" not in second.stdout + second.stderr and "step=" not in second.stdout
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the launcher and its worker: no handler runs
        process.wait(30)
    sealed = tmp_path / "runs" / "default" / "checkpoints" / "step-4"
    assert verify_folder(sealed, 4).files.keys() == {"lightning.ckpt"}
    assert (sealed / "lightning.ckpt").stat().st_ino == (
        tmp_path / "lightning-checkpoints" / "epoch=0-step=4.ckpt").stat().st_ino  # linked, not copied

    result = _launch(tmp_path, 1, script, "12")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "resuming from runs/default/checkpoints/step-4/lightning.ckpt" in output
    assert "step=12" in result.stdout
    starts = records(tmp_path / "runs" / "default", "run_start")
    assert [(start["attempt"], start["resumed_from_step"]) for start in starts] == [(1, None), (2, 4)]
    # ModelCheckpoint's later files are sealed as they are written (8, 12); keep=3 complete ones.
    assert sorted(path.name for path in (tmp_path / "runs" / "default" / "checkpoints").iterdir()) == [
        "step-12", "step-4", "step-8"]


# -- the loss skylift records --------------------------------------------------------------


def _logged_and_recorded(output_dir: Path) -> list[tuple[float, float]]:
    import json

    from tests.integrations.records import losses_by_step

    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    logged = {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}
    recorded = losses_by_step(output_dir)
    assert sorted(recorded) == sorted(logged) == [1, 2]
    return [(logged[step], recorded[step]) for step in (1, 2)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_recorded_loss_is_per_sample_on_two_processes_whichever_way_the_model_divides(tmp_path):
    """BERT's head takes the Trainer's item count in **kwargs but computes its own mean: the
    Trainer logs it times the 2 processes. A Llama's loss divides by the count: the Trainer's
    figure is already per sample. An untrained head over 2 labels loses about ln 2 per sample."""
    for kind in ("bert", "llama"):
        result = _launch(tmp_path, 2, str(PROGRAMS / "loss_scale_job.py"), kind, kind)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for logged, recorded in _logged_and_recorded(tmp_path / "bert"):
        assert recorded == logged / 2 and 0.6 < recorded < 0.8, (logged, recorded)
    for logged, recorded in _logged_and_recorded(tmp_path / "llama"):
        assert recorded == logged and 3.5 < recorded < 4.8, (logged, recorded)  # ln 64 = 4.16


# -- run records as the framework ran the job -------------------------------------------------


def _assert_config_describes(framework: str, run_dir: Path, *lines: str) -> None:
    import yaml

    text = (run_dir / "config.yaml").read_text()
    assert text.startswith(f"# A {framework} job: the framework's own arguments describe its model, data and training")
    assert all(f"#   {line}" in text.splitlines() for line in lines), text
    # Only what skylift applied: no recipe, data, model or optimizer defaults posing as the job's.
    assert list(yaml.safe_load(text)) == ["run_dir", "preemption", "monitor", "checkpoint"]


def test_lightning_run_records_state_its_per_device_batch_and_config_yaml_only_what_skylift_applied(tmp_path):
    from examples.integrations import lightning_job
    from skylift.config.load import load_config
    from skylift.integrations.lightning import SkyliftCallback
    from tests.integrations.records import records

    config = load_config(None, ["preemption.cloud=off", "monitor.tensorboard=false", "monitor.report=false",
                                "monitor.system_interval_s=0", f"run_dir={tmp_path}"])
    callback = SkyliftCallback(config, exit_on_stop=False)
    lightning_job.trainer([callback], max_steps=2).fit(lightning_job.Classifier(), lightning_job.loader())
    [start] = records(tmp_path, "run_start")
    assert (start["micro_batch_size"], start["accumulation_steps"]) == (lightning_job.BATCH, 1)
    _assert_config_describes("Lightning Trainer", tmp_path, f"per_device_batch_size: {lightning_job.BATCH}",
                             "max_steps: 2", "strategy: SingleDeviceStrategy")


# -- the run lease ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_trainer_job_is_refused_while_another_live_job_holds_its_checkpoint_folder(tmp_path):
    from examples.integrations import hf_job
    from skylift.checkpoint.lease import LeaseHeldError, RunLease
    from skylift.config.load import load_config
    from skylift.integrations.transformers import SkyliftCallback
    from skylift.storage.local import LocalStore

    output_dir = tmp_path / "out"
    output_dir.mkdir()
    other = RunLease(LocalStore(output_dir), job_id="the-other-job")
    other.acquire()  # this process is alive: the lease is live
    try:
        config = load_config(None, ["preemption.cloud=off", "monitor.tensorboard=false", "monitor.report=false",
                                    "monitor.system_interval_s=0", f"run_dir={tmp_path / 'run'}"])
        trainer = hf_job.trainer(output_dir, callbacks=[SkyliftCallback(config, exit_on_stop=False)], max_steps=2)
        with pytest.raises(LeaseHeldError, match="run owned by job the-other-job on .*another job is writing"):
            trainer.train()
        assert trainer.state.global_step == 0 and not list(output_dir.glob("checkpoint-*"))
    finally:
        other.release()
    # Once it is released the job runs, and releases the lease in turn.
    trainer = hf_job.trainer(output_dir, callbacks=[SkyliftCallback(config, exit_on_stop=False)], max_steps=2)
    trainer.train()
    assert trainer.state.global_step == 2
    from skylift.checkpoint.lease import current_holder

    holder = current_holder(LocalStore(output_dir))
    assert holder["released"] is True and holder["job_id"].startswith("trainer-")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_trainer_job_whose_lease_another_job_took_over_stops_every_rank_with_one_line(tmp_path):
    import re
    import signal
    import time

    from skylift.checkpoint.lease import RunLease, current_holder
    from skylift.storage.local import LocalStore

    output_dir = tmp_path / "out"
    job = subprocess.Popen(
        [sys.executable, "-m", "skylift", "launch", "--nproc", "2", "--no-doctor", "--", "python",
         str(PROGRAMS / "lease_takeover_job.py"), str(output_dir)],
        cwd=tmp_path, env=_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    store = LocalStore(output_dir)
    new_job = RunLease(store, job_id="the-new-job")
    try:
        deadline = time.monotonic() + 180
        rank_0 = None
        while rank_0 is None or _process_state(rank_0) != "T":  # rank 0 paused itself at step 4
            if job.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(job.communicate()[0][-4000:])
            time.sleep(0.1)
            holder = current_holder(store) if (output_dir / "lease").is_dir() else None
            rank_0 = int(holder["pid"]) if holder else None
        try:
            time.sleep(3.0)  # past the job's 2 s lease
            new_job.acquire()  # the lease is stale: another job takes it over
        finally:
            os.kill(rank_0, signal.SIGCONT)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    try:
        assert job.returncode == 1, output[-4000:]
        errors = [line for line in output.splitlines() if line.startswith("skylift: error:")]
        assert len(errors) == 1, output[-4000:]  # rank 0's line, not one per rank
        # One step boundary to learn it, one for the ranks' agreement (exchanged a step late).
        assert re.match(r"skylift: error: stopped at step [45]: .*/lease: the run lease was taken over by job "
                        r"the-new-job on .* \(pid \d+\) after this job's heartbeat went unrenewed for more than "
                        r"checkpoint.lease_ttl_s \(2 s; was the process paused\?\); this job stops without writing "
                        r"the checkpoint root again$", errors[0]), errors[0]
        assert "Traceback" not in output, output[-4000:]
        assert "trained step=" not in output
        # Nothing more written to the root the new job holds: not step 6's checkpoint, no release of its lease.
        assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-3"]
        holder = current_holder(store)
        assert holder["job_id"] == "the-new-job" and not holder["released"]
    finally:
        new_job.release()


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped), or ``?`` once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except (OSError, IndexError):
        return "?"

"""The same runs on a CUDA GPU: precision chosen from the GPU, NVML figures, CUDA-event
step breakdown, MFU against the GPU's peak, torch.compile, and a kill -9 resumed bit
for bit with fp16 and a GradScaler. Skipped without a GPU (marker ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from skylift.monitor.schema import read_records
from tests.checkpoint.runs import assert_same_run, losses_by_step, summary, train
from tests.conftest import run_cli

pytestmark = pytest.mark.gpu

KILLED = -9


def _run(run_dir, *overrides: str, env: dict[str, str] | None = None):
    args = ["run", "examples/quickstart.yaml", "--json", "--set", f"run_dir={run_dir}", "--set", "device=cuda"]
    for override in overrides:
        args += ["--set", override]
    return run_cli(*args, env=env, timeout_s=600)


def _records(run_dir, kind: str) -> list[dict]:
    return [record for record in read_records(run_dir / "metrics.jsonl") if record["kind"] == kind]


def test_auto_precision_follows_the_gpu_and_the_run_learns(tmp_path):
    result = _run(tmp_path, "schedule.epochs=5", "monitor.breakdown_every_steps=5")
    assert result.returncode == 0, result.stderr[-3000:]
    done = summary(tmp_path)
    major, _ = torch.cuda.get_device_capability()
    assert done["device"].startswith("cuda")
    assert done["precision"] == ("bf16" if major >= 8 else "fp16")
    assert done["eval_metrics"]["accuracy"] >= 0.9

    start = _records(tmp_path, "run_start")[0]
    assert start["device_name"] == torch.cuda.get_device_name()
    assert start["peak_flops_source"] != "unknown", "this GPU's peak belongs in the table"

    trains = _records(tmp_path, "train")
    assert all(0 < record["mfu"] < 1 for record in trains if record.get("mfu") is not None)
    assert any(record.get("mfu") for record in trains)
    sampled = [record["breakdown_s"] for record in trains if record.get("breakdown_s")]
    assert sampled, "CUDA-event breakdowns were recorded"
    assert all(phase["forward_backward"] > 0 for phase in sampled)

    gpus = [gpu for record in _records(tmp_path, "system") for gpu in record["gpus"]]
    assert gpus, "NVML figures were sampled"
    assert all(gpu["memory_total_gib"] > 1 for gpu in gpus)
    assert any(gpu["memory_used_gib"] for gpu in gpus)


def test_fp16_with_grad_scaler_resumes_bit_for_bit_after_kill9(tmp_path):
    gpu = ("device=cuda", "precision=fp16")
    reference = tmp_path / "reference"
    result = train(reference, *gpu)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(reference)["precision"] == "fp16"

    run_dir = tmp_path / "run"
    for point in ("step_end:step=17", "during_payload:step=28", "step_end:step=44"):
        killed = train(run_dir, *gpu, env={"SKYLIFT_FAULT_INJECTION": point})
        assert killed.returncode == KILLED, f"{point} did not kill the run:\n{killed.stderr[-2000:]}"
    final = train(run_dir, *gpu)
    assert final.returncode == 0, final.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 42
    assert_same_run(run_dir, reference)


def test_compiled_model_trains_on_the_gpu(tmp_path):
    result = _run(tmp_path, "schedule.epochs=3", "compile.enabled=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(tmp_path)["eval_metrics"]["accuracy"] >= 0.85


def test_gpu_checkpoint_resumes_on_the_cpu(tmp_path):
    killed = train(tmp_path, "device=cuda", env={"SKYLIFT_FAULT_INJECTION": "step_end:step=23"})
    assert killed.returncode == KILLED, killed.stderr[-2000:]
    resumed = train(tmp_path, "device=cpu")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(tmp_path)["resumed_from_step"] == 21
    assert summary(tmp_path)["device"] == "cpu"
    assert max(losses_by_step(tmp_path)) == 60


def test_a_worker_forked_from_the_preloaded_server_trains_on_the_gpu(tmp_path):
    """The fork server imports torch and the trainer, never CUDA, so a worker forked from it
    can initialise CUDA. One GPU: an elastic 1:2 job alone on its node, whose launcher forks
    one worker after the rendezvous's last call."""
    from tests.servers import free_port

    elastic = ("distributed.nodes.min=1", "distributed.nodes.max=2", "distributed.nodes.last_call_s=1")
    result = run_cli("run", "examples/quickstart.yaml", "--json", "--no-doctor", "--nproc", "1", "--node-rank", "0",
                     "--master-addr", "127.0.0.2", "--master-port", str(free_port()), "--one-machine",
                     "--set", f"run_dir={tmp_path}",
                     "--set", "device=cuda", *(item for setting in elastic for item in ("--set", setting)),
                     timeout_s=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(tmp_path)["device"].startswith("cuda")

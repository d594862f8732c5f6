"""``skylift doctor``, ``skylift dockerfile`` and the checks ``run``/``launch`` do first, as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO_ROOT, run_cli

SHM_CONFIG = """\
run_dir: {run_dir}
recipe: {{name: image_classification, model: small_cnn, dataset: synthetic_images, image_size: 224, num_samples: 64}}
data: {{num_workers: 2, global_batch_size: 64}}
schedule: {{epochs: 1, max_steps: 1, warmup_steps: 0}}
"""


def test_doctor_runs_here_in_seconds_and_says_nvml_is_missing():
    started = time.perf_counter()
    result = run_cli("doctor")
    assert result.returncode == 0, result.stderr
    assert time.perf_counter() - started < 30  # seconds on a quiet machine; 2 shared cores here
    assert "no GPU visible" in result.stdout and "NVML" in result.stdout
    assert result.stdout.splitlines()[-1].endswith("exit 0")


def test_doctor_json_is_the_documented_schema(cli_here):
    result = cli_here("doctor", "--json", "--config", "examples/quickstart.yaml")
    report = json.loads(result.stdout)
    assert result.returncode == report["exit_code"] == 0
    assert report["schema_version"] == 1 and report["facts"]["job"]["config_path"] == "examples/quickstart.yaml"
    assert report["facts"]["driver"]["nvml"] is False


def test_a_socket_ifname_naming_a_missing_interface_fails_with_exit_1(cli_here):
    result = cli_here("doctor", env={"NCCL_SOCKET_IFNAME": "skylift-missing0"})
    assert result.returncode == 1
    assert "FAIL  nccl-socket-ifname" in result.stdout and "fix: export NCCL_SOCKET_IFNAME=" in result.stdout


def test_a_bad_config_is_exit_2_naming_the_field(cli_here, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("data: {num_workerz: 2}\n")
    result = cli_here("doctor", "--config", str(config))
    assert result.returncode == 2 and "num_workerz" in result.stderr


def _in_small_shm(command: list[str], size: str = "64m") -> subprocess.CompletedProcess:
    """``command`` with /dev/shm replaced by a small tmpfs in a private mount namespace."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private mount namespace")
    script = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$@"'
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "mount:" in result.stderr and "permission denied" in result.stderr.lower():
        pytest.skip("tmpfs mounts are not allowed here")
    return result


def test_a_real_small_shm_is_detected(tmp_path):
    config = tmp_path / "shm.yaml"
    config.write_text(SHM_CONFIG.format(run_dir=tmp_path / "run"))
    result = _in_small_shm([sys.executable, "-m", "skylift", "doctor", "--json", "--config", str(config)])
    report = json.loads(result.stdout)
    shm = next(v for v in report["verdicts"] if v["rule"] == "shm")
    assert report["facts"]["shm"]["total_bytes"] == 64 * 1024**2
    assert shm["status"] == "fail" and "--ipc=host" in shm["fix"] and result.returncode == 1


def test_skylift_run_stops_in_seconds_before_any_worker(tmp_path):
    config = tmp_path / "shm.yaml"
    config.write_text(SHM_CONFIG.format(run_dir=tmp_path / "run"))
    started = time.perf_counter()
    result = _in_small_shm([sys.executable, "-m", "skylift", "run", str(config), "--nproc", "2"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "shm: /dev/shm has 64 MiB free" in result.stderr and "--no-doctor" in result.stderr
    assert time.perf_counter() - started < 60
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_no_doctor_skips_the_checks(monkeypatch):
    from skylift.doctor import gate

    assert gate.check_before_start(None, command="launch", nproc=1, nnodes=1, enforce=False) is None
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "skylift-missing0")
    facts = gate.check_before_start(None, command="launch", nproc=2, nnodes=1, enforce=False)
    assert facts is not None and facts.job.source == "launch"


def test_dockerfile_prints_and_writes_with_a_dockerignore(cli_here, tmp_path):
    printed = cli_here("dockerfile", "--config", "examples/quickstart.yaml")
    assert printed.returncode == 0 and printed.stdout.startswith("# syntax=docker/dockerfile:1")
    out = tmp_path / "image" / "Dockerfile"
    written = cli_here("dockerfile", "--base", "cuda", "--out", str(out))
    assert written.returncode == 0, written.stderr
    assert out.read_text().count("FROM nvidia/cuda:") == 1 and (out.parent / ".dockerignore").is_file()

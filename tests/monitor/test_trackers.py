"""MLflow and Weights & Biases exporters on real runs: a local SQLite store, a real
``mlflow server`` process on 127.0.0.1, and W&B's offline mode read back from its own
run file with W&B's own protobuf records."""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checkpoint.runs import records, state_kept, train, train_arguments
from tests.conftest import REPO_ROOT
from tests.servers import free_port
from tests.test_secrets import SECRET_SETS, assert_no_secret

pytest.importorskip("mlflow")
STEPS = ("schedule.max_steps=30", "monitor.log_every_steps=5")


def _train_here(cli_here, run_dir: Path, *overrides: str):
    """:func:`train`'s run in this process (``cli_here`` in ``state_kept``: one thread, as
    ``train`` gives its subprocess), for a run whose start is not under test: a resume or a run
    whose exports are only read. The exporter talks to MLflow through its client, whose import
    this process has already paid (this module imports it); a ``skylift run`` pays it and torch's.

    MLflow decides at import whether it runs under a test (``PYTEST_CURRENT_TEST``, which a
    test's subprocess inherits): here it was imported at collection, before pytest sets that,
    so its usage telemetry would try to reach config.mlflow-telemetry.io from the run's calls
    (the network guard fails the test). ``MLFLOW_DISABLE_TELEMETRY``, read at every call, turns
    it off for the run as the inherited variable does in a subprocess."""
    with state_kept():
        return cli_here(*train_arguments(run_dir, *overrides), env={"MLFLOW_DISABLE_TELEMETRY": "true"})


def _losses(run_dir: Path) -> dict[int, float]:
    return {record["step"]: record["loss"] for record in records(run_dir, "train")}


@pytest.fixture(scope="module")
def mlflow_schema(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store with MLflow's tables made, once for the module: creating them
    runs MLflow's whole migration history (seconds). Each test copies it, so no test sees another's
    runs; the server's store starts as a team's existing one does."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-schema") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def _mlflow_run(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "skylift"]
    runs = client.search_runs([experiment.experiment_id])
    return client, runs


@pytest.mark.slow
def test_mlflow_gets_params_metrics_and_artifacts_and_a_resumed_run_stays_one_run(mlflow_schema, cli_here, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{shutil.copy(mlflow_schema, tmp_path / 'mlflow.db')}"
    assert MlflowClient(tracking_uri=uri).search_experiments()  # the team's store exists before the job (schema made)
    run_dir = tmp_path / "run"
    exporting = ("monitor.exporters=[mlflow]", f"monitor.mlflow.tracking_uri={uri}", *STEPS)
    killed = train(run_dir, *exporting, env={"SKYLIFT_FAULT_INJECTION": "step_end:step=17"})  # a real SIGKILL
    assert killed.returncode == -9
    resumed = _train_here(cli_here, run_dir, *exporting)  # only what it exports is read
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    client, runs = _mlflow_run(uri)
    assert len(runs) == 1, [run.info.run_id for run in runs]  # the kill and the resume: one MLflow run
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["precision"] == "fp32"
    assert run.data.tags["skylift.version"] == "0.1.0"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    last_by_step = {}
    for metric in sorted(history, key=lambda m: m.timestamp):
        last_by_step[metric.step] = metric.value
    assert last_by_step == _losses(run_dir)  # every step, the redone ones with their final value
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "report"} <= artifacts


def test_params_an_attempt_was_killed_before_logging_are_logged_by_the_resume(mlflow_schema, tmp_path, monkeypatch):
    """The state a SIGKILL leaves when it lands while the exporter opens beside the training
    (the run made and its id saved, no param logged yet): the resume logs them to that run."""
    from mlflow.tracking import MlflowClient

    from skylift.config.load import load_config
    from skylift.monitor.exporters import RunInfo
    from skylift.monitor.exporters.mlflow import MlflowExporter

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # see _train_here
    uri = f"sqlite:///{shutil.copy(mlflow_schema, tmp_path / 'mlflow.db')}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(REPO_ROOT / "examples" / "quickstart.yaml",
                         [f"run_dir={run_dir}", "monitor.exporters=[mlflow]", f"monitor.mlflow.tracking_uri={uri}"])
    client = MlflowClient(tracking_uri=uri)
    killed = client.create_run(client.create_experiment(config.monitor.mlflow.experiment)).info.run_id
    (run_dir / "exporters.json").write_text(json.dumps({"mlflow_run_id": killed}))
    for _attempt in range(2):  # the resume, then one more: the second logs nothing again
        exporter = MlflowExporter(config)
        exporter.open(RunInfo(config, run_id="kept", resumed=True))
        assert exporter.run_id == killed
    (_, runs) = _mlflow_run(uri)
    assert [run.info.run_id for run in runs] == [killed]
    assert runs[0].data.params["optim.lr"] == str(config.optim.lr)
    assert json.loads((run_dir / "exporters.json").read_text())["mlflow_params_logged"] is True


@pytest.mark.slow
def test_mlflow_through_a_real_tracking_server_on_loopback(mlflow_schema, cli_here, tmp_path):
    port = free_port()
    store = shutil.copy(mlflow_schema, tmp_path / "server.db")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{store}", "--artifacts-destination",
         str(tmp_path / "artifacts")],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        # Tracking only: the server's job runner (GenAI evaluation jobs) is a process and seven
        # task consumers of its own, ~11 s of CPU before the first request, for nothing here.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_for_http(f"{uri}/health", server)
        run_dir = tmp_path / "run"
        # The server is the real process here; the run that talks to it over HTTP trains in this one.
        result = _train_here(cli_here, run_dir, "monitor.exporters=[mlflow]", f"monitor.mlflow.tracking_uri={uri}",
                             *STEPS)
        assert result.returncode == 0, result.stderr[-3000:]
        client, runs = _mlflow_run(uri)
        (run,) = runs
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 30
        assert "summary.json" in {item.path for item in client.list_artifacts(run.info.run_id)}
        assert (tmp_path / "artifacts").rglob("summary.json")  # uploaded through the server
    finally:
        server.terminate()
        server.wait(30)


def _wait_for_http(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:  # a raise, not an assert: a poll is not a check that passed
            raise AssertionError(process.stderr.read().decode()[-2000:])
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout_s} s")


def _wandb_history(run_file: str) -> tuple[str, list[dict[str, float]]]:
    """The run id and history rows of a W&B run file: W&B's LevelDB-style log of its own
    protobuf ``Record`` messages (a 7-byte ``:W&B`` header, 32 KiB blocks, records of a
    7-byte header (crc32, length, type: full, first, middle, last) and a payload)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B"
    block, position, payloads, pending = 32768, 7, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 0:
            break
        if kind == 1:
            payloads.append(chunk)
        elif kind in (2, 3):
            pending = chunk if kind == 2 else pending + chunk
        else:
            payloads.append(pending + chunk)
    run_id, rows = None, []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "run":
            run_id = record.run.run_id
        elif record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return run_id, rows


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_and_a_resume_continues_its_id(tmp_path):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    exporting = ("monitor.exporters=[wandb]", "monitor.wandb.mode=offline", *STEPS)
    env = {"WANDB_SILENT": "true"}
    killed = train(run_dir, *exporting, env={**env, "SKYLIFT_FAULT_INJECTION": "step_end:step=17"})
    assert killed.returncode == -9
    resumed = train(run_dir, *exporting, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(run_files) == 2
    ids_and_rows = [_wandb_history(path) for path in run_files]
    own_id = (run_dir / "run_id").read_text().strip()
    # The killed attempt's file holds what W&B's service wrote before the SIGKILL (maybe not its
    # run record); the resume continues the same run id and first sends what that attempt lost.
    assert ids_and_rows[-1][0] == own_id and {run_id for run_id, _ in ids_and_rows} <= {own_id, None}
    logged = {}
    for _, rows in ids_and_rows:
        for row in rows:
            if "train/loss" in row:
                logged[row["trainer/step"]] = row["train/loss"]
    assert logged == _losses(run_dir)


def test_mlflow_params_hold_no_secret(mlflow_schema, tmp_path, monkeypatch):
    """Every submit.envs value (any name) and every URL's user-info is redacted in the params."""
    from skylift.cloud.redact import REDACTED
    from skylift.config.load import load_config
    from skylift.monitor.exporters import RunInfo
    from skylift.monitor.exporters.mlflow import MlflowExporter

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # see _train_here
    uri = f"sqlite:///{shutil.copy(mlflow_schema, tmp_path / 'mlflow.db')}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(REPO_ROOT / "examples" / "quickstart.yaml",
                         [f"run_dir={run_dir}", "monitor.exporters=[mlflow]", *SECRET_SETS[:2], SECRET_SETS[3]])
    config.monitor.mlflow.tracking_uri = uri  # the exporter still reaches the store with the real value
    exporter = MlflowExporter(config)
    exporter.open(RunInfo(config, run_id="kept", resumed=False))
    (_, (run,)) = _mlflow_run(uri)
    params = run.data.params
    assert_no_secret(json.dumps(params), "MLflow params")
    assert params["submit.envs.NOTE"] == REDACTED and params["optim.lr"] == str(config.optim.lr)


def test_wandb_config_holds_no_secret(tmp_path, monkeypatch):
    """W&B's offline run files (its config and its debug log) hold no secret in clear."""
    pytest.importorskip("wandb")
    from skylift.config.load import load_config
    from skylift.monitor.exporters import RunInfo
    from skylift.monitor.exporters.wandb import WandbExporter

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_config(REPO_ROOT / "examples" / "quickstart.yaml",
                         [f"run_dir={run_dir}", "monitor.exporters=[wandb]", "monitor.wandb.mode=offline",
                          *SECRET_SETS])
    exporter = WandbExporter(config)
    exporter.open(RunInfo(config, run_id="kept", resumed=False))
    exporter.run.finish()
    files = [path for path in Path(run_dir, "wandb").rglob("*") if path.is_file()]
    assert any(path.suffix == ".wandb" for path in files)
    for path in files:
        assert_no_secret(path.read_bytes().decode("utf-8", errors="replace"), f"W&B {path.name}")

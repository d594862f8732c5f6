"""MLflow: the resolved config as params, figures as metrics with their steps, the report
and ``summary.json`` as artifacts. The MLflow run's id is kept in ``RUN_DIR/exporters.json``,
so a run resumed after a preemption continues the same MLflow run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from skylift.monitor.exporters import RunInfo
from skylift.monitor.exporters._records import flat_params, scalars_of
from skylift.monitor.exporters.hub import _save_state, _state

__all__ = ["MlflowExporter"]

_BATCH = 1000
"""log_batch takes at most 1,000 metrics, 100 params and 100 tags a call."""


class MlflowExporter:
    name = "mlflow"
    durable = True

    def __init__(self, config: Any) -> None:
        from mlflow.tracking import MlflowClient  # noqa: F401 - fail at build time, with the pip hint

        self.settings = config.monitor.mlflow
        self.client: Any = None
        self.run_id: str | None = None
        self._run_dir = Path(str(config.run_dir))
        self._finished = False

    def open(self, run: RunInfo) -> None:
        import os

        from mlflow.tracking import MlflowClient

        uri = self.settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{(self._run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        state_path = self._run_dir / "exporters.json"
        state = _state(state_path)
        self.run_id = state.get("mlflow_run_id")
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self._create_run(run, uri)
            _save_state(state_path, mlflow_run_id=self.run_id)
        # Opening runs beside the training: an attempt killed after the run's id was saved and
        # before every param was logged leaves it to the next attempt (logging a param again
        # with its value is allowed), so the run is made once and its params are never lost.
        if not state.get("mlflow_params_logged"):
            self._log_params(run)
            _save_state(state_path, mlflow_params_logged=True)

    def _create_run(self, run: RunInfo, uri: str) -> str:
        experiment = self.client.get_experiment_by_name(self.settings.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(self.settings.experiment,
                                                          artifact_location=_local_artifacts(uri))
        return self.client.create_run(experiment_id, run_name=self._run_dir.name, tags=_tags(run)).info.run_id

    def _log_params(self, run: RunInfo) -> None:
        from mlflow.entities import Param

        from skylift.cloud.redact import redact_config

        # No secret in clear: submit.envs values and URLs' user-info are redacted.
        resolved = redact_config(run.config.model_dump(mode="json"))
        params = [Param(key, value) for key, value in flat_params(resolved).items()]
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def export(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics = []
        for record in records:
            if record.get("kind") == "run_end":
                self._finished = record.get("stopped_early") is None
            stamp_ms = int(1000 * record.get("time", time.time()))
            step = int(record.get("step") or 0)
            metrics += [Metric(key, value, stamp_ms, step) for key, value in scalars_of(record).items()]
        for start in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + _BATCH])

    def close(self) -> None:
        for name in ("summary.json", "report"):
            path = self._run_dir / name
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path))
            elif path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=name)
        # A stopped run (preempted, a guard) stays RUNNING until the resume that finishes it.
        if self._finished:
            self.client.set_terminated(self.run_id, status="FINISHED")


def _local_artifacts(uri: str) -> str | None:
    """Beside a local SQLite store, not MLflow's default ``./mlruns`` in whatever folder the
    job started in; a tracking server decides for itself (None)."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).parent / "mlflow-artifacts").resolve().as_uri()


def _tags(run: RunInfo) -> dict[str, str]:
    import subprocess

    from skylift import __version__

    tags = {"skylift.version": __version__, "skylift.run_id": run.run_id}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                check=False)
        if commit.returncode == 0:
            tags["mlflow.source.git.commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    if run.config.submit.instance_type:
        tags["skylift.instance_type"] = run.config.submit.instance_type
    return tags

"""Weights & Biases: the resolved config, figures against the optimizer step, the report
and ``summary.json`` as files. The W&B run id is the run folder's own (``RUN_DIR/run_id``)
with ``resume="allow"``, so a run resumed after a preemption continues the same W&B run;
``monitor.wandb.mode: offline`` needs no account (``wandb sync RUN_DIR/wandb/offline-run-*``
uploads it later)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skylift.monitor.exporters import RunInfo
from skylift.monitor.exporters._records import scalars_of

__all__ = ["WandbExporter"]


class WandbExporter:
    name = "wandb"
    durable = False

    def __init__(self, config: Any) -> None:
        import wandb  # noqa: F401 - fail at build time, with the pip hint

        self.settings = config.monitor.wandb
        self.run: Any = None
        self._run_dir = Path(str(config.run_dir))

    def open(self, run: RunInfo) -> None:
        import os

        if self.settings.mode == "offline":
            # Offline means nothing leaves the machine: W&B still reports its own errors and
            # telemetry to its cloud unless this is off (found by the test suite's network guard).
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        import wandb

        from skylift.cloud.redact import redact_config

        self.run = wandb.init(
            project=self.settings.project, entity=self.settings.entity, mode=self.settings.mode,
            id=run.run_id, resume="allow", name=self._run_dir.name, dir=str(self._run_dir),
            config=redact_config(run.config.model_dump(mode="json")), reinit="create_new",
        )
        # Records come in bursts of steps and sampler times: each family against its own axis.
        self.run.define_metric("trainer/step")
        for family in ("train/*", "eval/*", "cost/*", "system/*"):
            self.run.define_metric(family, step_metric="trainer/step")

    def export(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            scalars = scalars_of(record)
            if scalars:
                self.run.log({**scalars, "trainer/step": int(record.get("step") or 0)})

    def close(self) -> None:
        for name in ("summary.json", "report/index.html"):
            path = self._run_dir / name
            if path.is_file():
                self.run.save(str(path), base_path=str(self._run_dir), policy="now")
        self.run.finish()

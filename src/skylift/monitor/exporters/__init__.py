"""Exporters: the records ``metrics.jsonl`` gets, also sent where a team already looks.

One small interface (:class:`Exporter`), one module per sink, each vendor package
imported only when its sink is named in ``monitor.exporters`` (a missing one is named
with its pip command). Records reach exporters on a background thread through a
bounded queue (:class:`~skylift.monitor.exporters.hub.ExportHub`): a slow or throttled
service never slows a training step, and when the queue is full the oldest records
are dropped and counted. Only rank 0 exports; the ``system`` records of every node reach
it at each flush and carry their ``node_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["EXPORTERS", "VENDOR_MODULES", "Exporter", "RunInfo", "build_exporter", "check_exporters"]

EXPORTERS: dict[str, tuple[str, str]] = {
    "cloudwatch": ("skylift.monitor.exporters.cloudwatch:CloudWatchExporter", "pip install 'skylift[cloudwatch]'"),
    "aliyun_cms": ("skylift.monitor.exporters.aliyun_cms:AliyunCmsExporter", "pip install 'skylift[aliyun-cms]'"),
    "mlflow": ("skylift.monitor.exporters.mlflow:MlflowExporter", "pip install 'skylift[mlflow]'"),
    "wandb": ("skylift.monitor.exporters.wandb:WandbExporter", "pip install 'skylift[wandb]'"),
}
"""Sink name -> (class by import path, how to install its vendor package)."""
VENDOR_MODULES = {"cloudwatch": "boto3", "aliyun_cms": "alibabacloud_cms20190101", "mlflow": "mlflow", "wandb": "wandb"}
"""The module each sink imports (checked on every rank before the run starts)."""


def check_exporters(names: Sequence[str]) -> None:
    """Every rank, and ``skylift check``: a named exporter's package is importable (else
    the pip command, before any work)."""
    import importlib.util

    from skylift.errors import SkyliftConfigError

    for name in names:
        if importlib.util.find_spec(VENDOR_MODULES[name]) is None:
            raise SkyliftConfigError(f"monitor.exporters: {name} needs the package {VENDOR_MODULES[name]!r}, "
                                     "which is not installed", hint=f"Install it with: {EXPORTERS[name][1]}")


class RunInfo:
    """What an exporter knows of the run when it opens."""

    def __init__(self, config: Any, *, run_id: str, resumed: bool) -> None:
        self.config = config
        self.run_dir = config.run_dir
        self.run_id = run_id
        """The run folder's own id (``RUN_DIR/run_id``, made at its first start), so a resumed
        run continues the same MLflow or W&B run."""
        self.resumed = resumed


class Exporter(Protocol):
    """A sink for the run's records. Calls come from one background thread, in order."""

    name: str
    durable: bool
    """Whether ``export`` returning means the records are kept (a synchronous API call). A sink
    that buffers (W&B's service) is counted as having them only once ``close`` returned, so
    a killed attempt's records are sent again by the resume."""

    def open(self, run: RunInfo) -> None:
        """Connect and describe the run (params, tags)."""

    def export(self, records: list[dict[str, Any]]) -> None:
        """Send a batch of validated records (any kinds; keep the ones this sink wants)."""

    def close(self) -> None:
        """Flush, upload final artifacts (report, summary) where the sink keeps them, disconnect."""


def build_exporter(name: str, config: Any) -> Exporter:
    """The exporter ``name``; raises SkyliftConfigError with the pip command when its package is missing."""
    import importlib

    from skylift.errors import SkyliftConfigError

    path, install = EXPORTERS[name]
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, class_name)(config)
    except ModuleNotFoundError as error:
        raise SkyliftConfigError(
            f"monitor.exporters: {name} needs the package {error.name!r}, which is not installed",
            hint=f"Install it with: {install}",
        ) from None

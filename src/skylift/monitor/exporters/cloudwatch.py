"""Amazon CloudWatch: the run's figures as custom metrics (``PutMetricData``).

Namespace ``monitor.cloudwatch.namespace``; dimensions ``Run`` (the run folder's name),
``Node``, ``GPU`` (per-GPU figures) and ``InstanceType`` when known. Region and
credentials come from boto3's usual chain; the endpoint from
``monitor.cloudwatch.endpoint_url`` or ``AWS_ENDPOINT_URL_CLOUDWATCH``. Batches of up to
1,000 values a call (the API's limit), retried under skylift's retry policy; this runs
on the export thread, so throttling never slows training.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skylift.monitor.exporters import RunInfo

__all__ = ["CloudWatchExporter", "metric_data"]

_BATCH = 1000
"""PutMetricData takes at most 1,000 metric values per request."""


def metric_data(record: dict[str, Any], dimensions: list[dict[str, str]], *, storage_resolution_s: int
                ) -> list[dict[str, Any]]:
    """The CloudWatch datums of one record (none for kinds CloudWatch does not get)."""
    kind = record.get("kind")
    stamp = datetime.datetime.fromtimestamp(record.get("time", 0), tz=datetime.timezone.utc)

    def datum(name: str, value: Any, unit: str, extra: Sequence[dict[str, str]] = ()) -> dict[str, Any] | None:
        if value is None:
            return None
        return {"MetricName": name, "Value": float(value), "Unit": unit, "Timestamp": stamp,
                "Dimensions": [*dimensions, *extra], "StorageResolution": storage_resolution_s}

    figures: list[dict[str, Any] | None] = []
    if kind == "train":
        step_s = record.get("step_time_s") or 0.0
        has_wait = step_s and record.get("data_wait_s") is not None
        wait_share = 100.0 * record["data_wait_s"] / step_s if has_wait else None
        figures = [datum("Loss", record.get("loss"), "None"),
                   datum("SamplesPerSecond", record.get("samples_per_s"), "Count/Second"),
                   datum("MFU", 100.0 * record["mfu"] if record.get("mfu") is not None else None, "Percent"),
                   datum("DataWaitShare", wait_share, "Percent")]
    elif kind == "system":
        node = [{"Name": "Node", "Value": str(record.get("node_rank", 0))}]
        figures = [datum("CPUUtilization", (record.get("host") or {}).get("cpu_percent"), "Percent", node)]
        for gpu in record.get("gpus") or []:
            per_gpu = [*node, {"Name": "GPU", "Value": str(gpu.get("index"))}]
            figures += [datum("GPUUtilization", gpu.get("utilization_percent"), "Percent", per_gpu),
                        datum("GPUMemoryUsed", gpu.get("memory_used_gib"), "Gigabytes", per_gpu),
                        datum("GPUPower", gpu.get("power_w"), "None", per_gpu)]
    elif kind == "cost":
        figures = [datum("USDSpent", record.get("usd_spent"), "None"),
                   datum("USDProjected", record.get("projected_usd_total"), "None")]
    return [figure for figure in figures if figure is not None]


class CloudWatchExporter:
    name = "cloudwatch"
    durable = True

    def __init__(self, config: Any) -> None:
        import boto3  # noqa: F401 - fail at build time, with the pip hint, when it is missing

        self.settings = config.monitor.cloudwatch
        self.client: Any = None
        self.dimensions: list[dict[str, str]] = []
        self.sent = 0
        """Metric values accepted by CloudWatch so far."""

    def open(self, run: RunInfo) -> None:
        import boto3

        endpoint = self.settings.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_CLOUDWATCH") or None
        self.client = boto3.session.Session().client("cloudwatch", region_name=self.settings.region,
                                                     endpoint_url=endpoint)
        self.dimensions = [{"Name": "Run", "Value": Path(str(run.run_dir)).name}]
        instance_type = run.config.submit.instance_type or os.environ.get("SKYLIFT_INSTANCE_TYPE")
        if instance_type:
            self.dimensions.append({"Name": "InstanceType", "Value": instance_type})

    def export(self, records: list[dict[str, Any]]) -> None:
        resolution = 1 if self.settings.high_resolution else 60
        data = [datum for record in records for datum in metric_data(record, self.dimensions,
                                                                     storage_resolution_s=resolution)]
        for start in range(0, len(data), _BATCH):
            self._put(data[start:start + _BATCH])

    def close(self) -> None:
        self.client = None

    def _put(self, batch: list[dict[str, Any]]) -> None:
        from skylift.storage.errors import StorageTransientError
        from skylift.storage.retry import RetryPolicy
        from skylift.storage.s3 import is_transient_aws_error

        def put() -> None:
            try:
                self.client.put_metric_data(Namespace=self.settings.namespace, MetricData=batch)
            except Exception as error:
                if is_transient_aws_error(error):
                    raise StorageTransientError(f"CloudWatch PutMetricData: {error}") from error
                raise

        RetryPolicy(deadline_s=self.settings.retry_deadline_s).run(put, what="CloudWatch PutMetricData")
        self.sent += len(batch)

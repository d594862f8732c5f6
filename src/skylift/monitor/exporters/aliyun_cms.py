"""Alibaba Cloud CloudMonitor: the run's figures as custom metrics (``PutCustomMetric``,
API version 2019-01-01), through the official ``alibabacloud-cms20190101`` SDK (extra
``aliyun-cms``).

The same figures and names as the CloudWatch sink (``Loss``, ``SamplesPerSecond``, ``MFU``,
``DataWaitShare``, ``CPUUtilization``, per GPU ``GPUUtilization``, ``GPUMemoryUsed``,
``GPUPower``, ``USDSpent``, ``USDProjected``), as raw values (``Type`` 0: CloudMonitor
aggregates them) in application group ``monitor.aliyun_cms.group_id``. Dimensions: ``Run``
(the run folder's name), ``InstanceType`` when known, ``monitor.aliyun_cms.dimensions``,
then ``Node`` and ``GPU`` where they apply. Region from ``monitor.aliyun_cms.region`` or
``ALIBABA_CLOUD_REGION_ID``; credentials only from the Alibaba Cloud credential chain
(environment, ``~/.aliyun/config.json``, the ECS RAM role), never from the config, and
never in a log line or an error. Batches of up to 21 values a call (the API's limit on
``MetricList``), retried under skylift's retry policy on the export thread.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from skylift.errors import SkyliftConfigError, SkyliftError
from skylift.monitor.exporters import RunInfo
from skylift.monitor.exporters.cloudwatch import metric_data

__all__ = ["AliyunCmsExporter", "CloudMonitorError", "metric_list"]

_BATCH = 21
"""PutCustomMetric takes at most 21 entries in ``MetricList``."""
_CONNECT_TIMEOUT_MS = 5_000
_READ_TIMEOUT_MS = 10_000
_TRANSIENT_CODES = ("Throttling", "ServiceUnavailable", "InternalError", "SystemBusy")
_CREDENTIALS_HINT = (
    "Set Alibaba Cloud credentials the Alibaba Cloud way: ALIBABA_CLOUD_ACCESS_KEY_ID and "
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET, or `aliyun configure` (~/.aliyun/config.json), or an ECS RAM role"
)
_NOT_A_DIMENSION = re.compile(r"[^A-Za-z0-9._/\\-]")


class CloudMonitorError(SkyliftError):
    """CloudMonitor refused a batch (not worth retrying); the text is its code and message."""


def metric_list(record: dict[str, Any], dimensions: dict[str, str], *, group_id: int) -> list[dict[str, str]]:
    """The ``MetricList`` entries of one record (none for kinds CloudMonitor does not get)."""
    entries = []
    for datum in metric_data(record, [], storage_resolution_s=60):
        if not math.isfinite(datum["Value"]):  # JSON has no NaN; CloudMonitor would refuse the batch
            continue
        own = {dimension["Name"]: dimension["Value"] for dimension in datum["Dimensions"]}
        entries.append({
            "GroupId": str(group_id),
            "MetricName": datum["MetricName"],
            "Dimensions": json.dumps({**dimensions, **own}, separators=(",", ":")),
            "Time": str(round(datum["Timestamp"].timestamp() * 1000)),  # milliseconds since the epoch
            "Type": "0",  # raw values
            "Values": json.dumps({"value": datum["Value"]}, separators=(",", ":")),
        })
    return entries


def _dimension_value(text: str) -> str:
    """``text`` in the characters CloudMonitor takes in a dimension, at most 64 of them."""
    return _NOT_A_DIMENSION.sub("_", text)[:64] or "_"


class AliyunCmsExporter:
    name = "aliyun_cms"
    durable = True

    def __init__(self, config: Any) -> None:
        import alibabacloud_cms20190101.client  # noqa: F401 - fail at build time, with the pip hint
        import alibabacloud_credentials.client  # noqa: F401

        from skylift.storage.retry import RetryPolicy

        self.settings = config.monitor.aliyun_cms
        self.region = self.settings.region or os.environ.get("ALIBABA_CLOUD_REGION_ID") or None
        self.retry = RetryPolicy(deadline_s=self.settings.retry_deadline_s)
        self.client: Any = None
        self.dimensions: dict[str, str] = {}
        self.sent = 0
        """Metric values accepted by CloudMonitor so far."""

    def open(self, run: RunInfo) -> None:
        from alibabacloud_cms20190101.client import Client
        from alibabacloud_tea_openapi.utils_models import Config

        if not self.region and not self.settings.endpoint:  # like boto3's NoRegionError: the hub warns, the run goes on
            raise SkyliftConfigError(
                "monitor.aliyun_cms.region: no region for CloudMonitor",
                hint="Set monitor.aliyun_cms.region (e.g. cn-hangzhou), ALIBABA_CLOUD_REGION_ID, "
                     "or monitor.aliyun_cms.endpoint")
        config = Config(credential=_credential(), region_id=self.region, connect_timeout=_CONNECT_TIMEOUT_MS,
                        read_timeout=_READ_TIMEOUT_MS)
        if self.settings.endpoint:
            scheme, sep, host = self.settings.endpoint.partition("://")
            config.endpoint, config.protocol = (host.rstrip("/"), scheme) if sep else (scheme, "https")
        self.client = Client(config)
        self.dimensions = {"Run": _dimension_value(Path(str(run.run_dir)).name)}
        instance_type = run.config.submit.instance_type or os.environ.get("SKYLIFT_INSTANCE_TYPE")
        if instance_type:
            self.dimensions["InstanceType"] = _dimension_value(instance_type)
        self.dimensions.update(self.settings.dimensions)

    def export(self, records: list[dict[str, Any]]) -> None:
        entries = [entry for record in records
                   for entry in metric_list(record, self.dimensions, group_id=self.settings.group_id)]
        for start in range(0, len(entries), _BATCH):
            self._put(entries[start:start + _BATCH])

    def close(self) -> None:
        self.client = None

    def _put(self, batch: list[dict[str, str]]) -> None:
        from alibabacloud_cms20190101 import models
        from alibabacloud_tea_openapi.exceptions import AlibabaCloudException
        from darabonba.exceptions import UnretryableException

        from skylift.storage.errors import StorageTransientError

        what = "CloudMonitor PutCustomMetric"

        def put() -> None:
            request = models.PutCustomMetricRequest().from_map({"MetricList": batch})
            try:
                answer = self.client.put_custom_metric(request).body
            except AlibabaCloudException as error:
                text = _describe(error)
                if _is_transient(error):
                    raise StorageTransientError(f"{what}: {text}") from None
                raise CloudMonitorError(f"{what}: {text}") from None
            except UnretryableException as error:  # no answer: refused, reset or timed out
                raise StorageTransientError(f"{what}: no answer ({_connection_problem(error)})") from None
            if answer is not None and answer.code not in (None, "200"):
                raise CloudMonitorError(f"{what}: answered {answer.code}: {_redacted(answer.message or '')}")

        self.retry.run(put, what=what)
        self.sent += len(batch)


def _credential() -> Any:
    """The Alibaba Cloud default credential chain, checked now so that a missing one says how to set it."""
    from alibabacloud_credentials.client import Client as CredentialClient

    try:
        credential = CredentialClient()
        credential.get_credential()
    except Exception:  # noqa: BLE001 - the chain's text lists providers; the hint says what to do
        raise SkyliftConfigError("monitor.exporters: aliyun_cms found no Alibaba Cloud credentials",
                                 hint=_CREDENTIALS_HINT) from None
    return credential


def _is_transient(error: Any) -> bool:
    from alibabacloud_tea_openapi.exceptions import ThrottlingException

    status = int(getattr(error, "status_code", 0) or 0)
    code = str(getattr(error, "code", "") or "")
    return (isinstance(error, ThrottlingException) or status >= 500 or status == 429
            or code.startswith(_TRANSIENT_CODES))


def _describe(error: Any) -> str:
    """CloudMonitor's code and message (the SDK's message holds the HTTP status and the request id)."""
    return _redacted(f"{getattr(error, 'code', '')} ({getattr(error, 'message', '') or ''})")


def _connection_problem(error: Any) -> str:
    inner = getattr(error, "inner_exception", None)
    text = str(getattr(inner, "message", None) or inner or type(error).__name__)
    return _redacted(re.sub(r"\?\S*", "", text))[:300]  # the URL's query holds the batch itself


def _redacted(text: str) -> str:
    from skylift.cloud.redact import redact

    return redact(text)

"""Tencent Cloud CVM spot instance reclamation notices.

Protocol (https://www.tencentcloud.com/document/product/213/32487):

* ``GET http://metadata.tencentyun.com/latest/meta-data/spot/termination-time``:
  404 while the instance is not a spot instance or not being reclaimed, then the
  reclamation time, e.g. ``2018-08-18 12:05:33``.
* That time is written without a zone and documented as UTC+8 (China Standard
  Time), whatever the instance's region; ISO 8601 with an explicit zone is also
  accepted.
"""

from __future__ import annotations

from datetime import timedelta, timezone

from skylift.cloud._protocol import MetadataError, http_request, parse_iso_time_s
from skylift.cloud.notice import PreemptionNotice, new_notice
from skylift.cloud.vendors import SKYLIFT_SPOT_LABEL, CloudVendor, KubernetesFlavour

__all__ = ["TENCENT_TIME_ZONE", "TERMINATION_TIME_PATH", "VENDOR", "poll"]

TERMINATION_TIME_PATH = "/latest/meta-data/spot/termination-time"
TENCENT_TIME_ZONE = timezone(timedelta(hours=8), "UTC+8")

VENDOR = CloudVendor(
    name="tencent",
    poll_module=__name__,
    # Tencent documents the termination-time item but no window; about two minutes
    # is the commonly observed lead (https://www.tencentcloud.com/document/product/213/32487).
    notice_window_s=120.0,
    poll_interval_s=5.0,
    metadata_host="http://metadata.tencentyun.com",
    dmi_signatures=(("sys_vendor", "Tencent Cloud"),),
    # https://www.tencentcloud.com/document/product/213/4934
    instance_type_path="/latest/meta-data/instance/instance-type",
    kubernetes=KubernetesFlavour("tke", {SKYLIFT_SPOT_LABEL: "spot"}, (
        {"key": SKYLIFT_SPOT_LABEL, "operator": "Equal", "value": "spot", "effect": "NoSchedule"},)),
)


def poll(base_url: str, timeout_s: float) -> PreemptionNotice | None:
    """One check of the termination time; a 200 is a notice even if its time is unreadable.

    Raises:
        MetadataError: an answer other than 200 or 404.
        OSError, urllib.error.HTTPError: transient failures, retried by the watcher.
    """
    response = http_request(base_url + TERMINATION_TIME_PATH, timeout_s=timeout_s)
    if response.status == 404:
        return None
    if response.status != 200:
        raise MetadataError(f"GET {TERMINATION_TIME_PATH} answered {response.status}")
    deadline_s = parse_iso_time_s(response.text, naive_tz=TENCENT_TIME_ZONE)
    return new_notice("tencent", "spot-termination", f"termination-time={response.text}", deadline_s)

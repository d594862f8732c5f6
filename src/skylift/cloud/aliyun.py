"""Alibaba Cloud ECS preemptible (spot) instance interruption notices.

Protocol (https://www.alibabacloud.com/help/en/ecs/user-guide/query-the-interruption-events-of-preemptible-instances,
https://www.alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata):

* ``GET /latest/meta-data/instance/spot/termination-time`` on ``100.100.100.200``: 404
  while the instance is not being reclaimed, then a UTC time such as
  ``2026-11-29T18:12:51Z``, about five minutes ahead.
* In security-hardening mode every GET needs a token from ``PUT /latest/api/token``
  with ``X-aliyun-ecs-metadata-token-ttl-seconds`` (1 to 21600), sent back in
  ``X-aliyun-ecs-metadata-token``. Normal mode accepts the token too, so it is always
  sent.
"""

from __future__ import annotations

from skylift.cloud._protocol import MetadataError, TokenSession, parse_iso_time_s
from skylift.cloud.notice import PreemptionNotice, new_notice
from skylift.cloud.vendors import SKYLIFT_SPOT_LABEL, CloudVendor, KubernetesFlavour

__all__ = ["SESSION", "TERMINATION_TIME_PATH", "TOKEN_TTL_S", "VENDOR", "poll"]

TOKEN_TTL_S = 21600  # the documented maximum
TERMINATION_TIME_PATH = "/latest/meta-data/instance/spot/termination-time"

SESSION = TokenSession(
    token_path="/latest/api/token",
    ttl_header="X-aliyun-ecs-metadata-token-ttl-seconds",
    token_header="X-aliyun-ecs-metadata-token",
    ttl_s=TOKEN_TTL_S,
)
"""The hardened mode's session tokens, shared by the notice watcher and ``skylift doctor``'s instance-type probe."""

VENDOR = CloudVendor(
    name="aliyun",
    poll_module=__name__,
    # "the instance enters the Pending Release status. Then, the instance is released
    # in about five minutes." https://www.alibabacloud.com/help/faq-detail/48269.htm
    notice_window_s=300.0,
    poll_interval_s=5.0,
    metadata_host="http://100.100.100.200",
    dmi_signatures=(("sys_vendor", "Alibaba Cloud"), ("product_name", "Alibaba Cloud ECS")),
    # https://www.alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata
    instance_type_path="/latest/meta-data/instance/instance-type",
    session=SESSION,
    kubernetes=KubernetesFlavour("ack", {SKYLIFT_SPOT_LABEL: "spot"}, (
        {"key": SKYLIFT_SPOT_LABEL, "operator": "Equal", "value": "spot", "effect": "NoSchedule"},)),
)


def poll(base_url: str, timeout_s: float) -> PreemptionNotice | None:
    """One check of the termination time; a 200 is a notice even if its time is unreadable.

    Raises:
        MetadataError: an answer other than 200 or 404.
        OSError, urllib.error.HTTPError: transient failures, retried by the watcher.
    """
    response = SESSION.get(base_url, TERMINATION_TIME_PATH, timeout_s=timeout_s)
    if response.status == 404:
        return None
    if response.status != 200:
        raise MetadataError(f"GET {TERMINATION_TIME_PATH} answered {response.status}")
    detail = f"termination-time={response.text}"
    return new_notice("aliyun", "spot-termination", detail, parse_iso_time_s(response.text))

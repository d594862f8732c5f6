"""AWS EC2 spot interruption and rebalance notices over IMDSv2.

Protocol (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html,
https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/configuring-instance-metadata-service.html):

* ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 21600`` returns
  a session token; every GET carries it in ``X-aws-ec2-metadata-token``. An expired or
  unknown token gets 401.
* ``GET /latest/meta-data/spot/instance-action``: 404 until interruption, then
  ``{"action": "terminate"|"stop"|"hibernate", "time": "2026-11-29T18:07:51Z"}``.
* ``GET /latest/meta-data/events/recommendations/rebalance``: 404, or
  ``{"noticeTime": "..."}`` when the instance is at elevated risk. It states no
  deadline (it may never be followed by an interruption), so the 120 s window from
  now is used as a conservative guess.
"""

from __future__ import annotations

import json

from skylift.cloud._protocol import MetadataError, TokenSession, parse_iso_time_s
from skylift.cloud.notice import PreemptionNotice, new_notice
from skylift.cloud.vendors import CloudVendor, KubernetesFlavour

__all__ = ["INSTANCE_ACTION_PATH", "REBALANCE_PATH", "SESSION", "TOKEN_TTL_S", "VENDOR", "poll"]

TOKEN_TTL_S = 21600  # the IMDSv2 maximum: six hours
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"

SESSION = TokenSession(
    token_path="/latest/api/token",
    ttl_header="X-aws-ec2-metadata-token-ttl-seconds",
    token_header="X-aws-ec2-metadata-token",
    ttl_s=TOKEN_TTL_S,
)
"""IMDSv2's session tokens, shared by the notice watcher and ``skylift doctor``'s instance-type probe."""

VENDOR = CloudVendor(
    name="aws",
    poll_module=__name__,
    # "two minutes before Amazon EC2 stops or terminates your Spot Instance"
    # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html
    notice_window_s=120.0,
    poll_interval_s=5.0,  # AWS recommends checking every 5 s
    metadata_host="http://169.254.169.254",
    dmi_signatures=(("sys_vendor", "Amazon EC2"), ("bios_version", "amazon")),  # older Xen: "4.11.amazon"
    # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-categories.html
    instance_type_path="/latest/meta-data/instance-type",
    session=SESSION,
    kubernetes=KubernetesFlavour("eks", {"karpenter.sh/capacity-type": "spot"}),
)


def poll(base_url: str, timeout_s: float) -> PreemptionNotice | None:
    """One check: the interruption notice first (it is the urgent one), then rebalance.

    Raises:
        MetadataError: an answer IMDS does not give (an unexpected status).
        OSError, urllib.error.HTTPError: transient failures, retried by the watcher.
    """
    action = _get_json(base_url, INSTANCE_ACTION_PATH, timeout_s)
    if action is not None:
        detail = f"action={action.get('action', '?')} time={action.get('time', '?')}"
        deadline_s = parse_iso_time_s(str(action.get("time", "")))
        return new_notice("aws", "spot-termination", detail, deadline_s)
    rebalance = _get_json(base_url, REBALANCE_PATH, timeout_s)
    if rebalance is not None:
        return new_notice("aws", "rebalance", f"noticeTime={rebalance.get('noticeTime', '?')}")
    return None


def _get_json(base_url: str, path: str, timeout_s: float) -> dict[str, object] | None:
    """The item's JSON object; None on 404. A 200 that is not JSON still counts as present."""
    response = SESSION.get(base_url, path, timeout_s=timeout_s)
    if response.status == 404:
        return None
    if response.status != 200:
        raise MetadataError(f"GET {path} answered {response.status}")
    try:
        value = json.loads(response.text)
    except ValueError:
        return {"raw": response.text}
    return value if isinstance(value, dict) else {"raw": response.text}

"""Azure spot eviction and termination notices through Scheduled Events.

Protocol (https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events):

* ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``
  (requests without it get 400) returns
  ``{"DocumentIncarnation": n, "Events": [{"EventId", "EventType", "ResourceType",
  "Resources": [vm names], "EventStatus", "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
  ...}]}``.
* ``Preempt`` is a spot eviction (NotBefore at least 30 s ahead); ``Terminate`` is a
  scale-set deletion with the user's configured delay. Reboot, Redeploy and Freeze
  leave the VM (and its disk) in place and are ignored.
* Events for every VM in an availability set or scale-set placement group reach all
  of them, so an event counts only when ``Resources`` names this VM
  (``/metadata/instance/compute/name``). If that name cannot be read, every event
  counts: a needless save beats a missed eviction.
* Once ``EventStatus`` is ``Started`` NotBefore is empty: the deadline is now.
* Events are never acknowledged here; that would hasten the eviction.
* The first call enables the service and may take minutes to answer; those timeouts
  are transient and retried.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from typing import Any

from skylift.cloud._protocol import MetadataError, http_request, parse_http_date_s
from skylift.cloud.notice import NoticeKind, PreemptionNotice, new_notice
from skylift.cloud.vendors import CloudVendor, KubernetesFlavour

__all__ = ["EVENTS_PATH", "VENDOR", "VM_NAME_PATH", "poll"]

log = logging.getLogger("skylift.cloud")

EVENTS_PATH = "/metadata/scheduledevents?api-version=2020-07-01"
VM_NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"

_REQUEST_HEADERS = {"Metadata": "true"}
_KINDS: dict[str, NoticeKind] = {"Preempt": "spot-termination", "Terminate": "maintenance"}
_vm_names: dict[str, str] = {}  # base_url -> this VM's name, read once
_vm_names_lock = threading.Lock()
_AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
_SPOT_LABEL = "kubernetes.azure.com/scalesetpriority"

VENDOR = CloudVendor(
    name="azure",
    poll_module=__name__,
    # Scheduled Events: Preempt is announced with a NotBefore at least 30 s ahead.
    # https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events
    notice_window_s=30.0,
    poll_interval_s=1.0,  # a 30 s window needs a tight loop to leave most of it for the save
    metadata_host="http://169.254.169.254",
    # Azure is told from plain Hyper-V by the chassis asset tag every Azure VM carries
    # (cloud-init's ds-identify uses the same).
    dmi_signatures=(("chassis_asset_tag", _AZURE_ASSET_TAG), ("board_asset_tag", _AZURE_ASSET_TAG)),
    # https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service
    instance_type_path="/metadata/instance/compute/vmSize?api-version=2021-02-01&format=text",
    request_headers=_REQUEST_HEADERS,
    kubernetes=KubernetesFlavour("aks", {_SPOT_LABEL: "spot"},
                                 ({"key": _SPOT_LABEL, "operator": "Equal", "value": "spot", "effect": "NoSchedule"},)),
)


def poll(base_url: str, timeout_s: float) -> PreemptionNotice | None:
    """One read of Scheduled Events; a Preempt wins over a Terminate.

    Raises:
        MetadataError: a non-200 answer or a body that is not the documented JSON.
        OSError, urllib.error.HTTPError: transient failures, retried by the watcher.
    """
    response = http_request(base_url + EVENTS_PATH, timeout_s=timeout_s, headers=_REQUEST_HEADERS)
    if response.status != 200:
        raise MetadataError(f"GET {EVENTS_PATH} answered {response.status}")
    try:
        events = json.loads(response.text).get("Events") or []
    except (ValueError, AttributeError) as error:
        raise MetadataError(f"GET {EVENTS_PATH}: not Scheduled Events JSON: {error}") from error
    candidates = [event for event in events if isinstance(event, dict) and event.get("EventType") in _KINDS]
    if not candidates:
        return None
    vm_name = _vm_name(base_url, timeout_s)
    mine = [event for event in candidates if _concerns_vm(event, vm_name)]
    mine.sort(key=lambda event: event.get("EventType") != "Preempt")
    return _notice(mine[0]) if mine else None


def _concerns_vm(event: dict[str, Any], vm_name: str | None) -> bool:
    resources = event.get("Resources") or []
    return vm_name is None or not resources or vm_name in resources


def _notice(event: dict[str, Any]) -> PreemptionNotice:
    not_before = str(event.get("NotBefore") or "")
    deadline_s = parse_http_date_s(not_before) if not_before else None
    if deadline_s is None and event.get("EventStatus") == "Started":
        deadline_s = time.time()
    detail = f"{event.get('EventType')} {event.get('EventId', '?')} NotBefore={not_before or '-'}"
    return new_notice("azure", _KINDS[event["EventType"]], detail, deadline_s)


def _vm_name(base_url: str, timeout_s: float) -> str | None:
    with _vm_names_lock:
        if base_url in _vm_names:
            return _vm_names[base_url]
    try:
        response = http_request(base_url + VM_NAME_PATH, timeout_s=timeout_s, headers=_REQUEST_HEADERS)
    except (OSError, http.client.HTTPException) as error:  # transient, HTTPError 5xx included
        log.debug("azure: could not read this VM's name (%r); counting every event", error)
        return None
    if response.status != 200 or not response.text:
        return None
    with _vm_names_lock:
        _vm_names[base_url] = response.text
    return response.text

"""Google Compute Engine spot/preemptible and host-maintenance notices.

Protocol (https://cloud.google.com/compute/docs/instances/create-use-preemptible#detecting_if_an_instance_was_preempted,
https://cloud.google.com/compute/docs/metadata/getting-live-migration-notice):

* Every request carries ``Metadata-Flavor: Google``; the server refuses others (403).
* Every genuine answer carries the response header ``Metadata-Flavor: Google``. Google's
  clients reject answers without it, since that is how a spoofed server shows itself;
  so does this module.
* ``GET /computeMetadata/v1/instance/preempted``: ``FALSE``, or ``TRUE`` once preemption
  began; the VM stops about 30 s later and no time is given.
* ``GET /computeMetadata/v1/instance/maintenance-event``: ``NONE``,
  ``MIGRATE_ON_HOST_MAINTENANCE`` (live migration: the VM survives, so no notice), or
  ``TERMINATE_ON_HOST_MAINTENANCE`` (the VM will be stopped). The lead time varies
  (60 s, up to an hour for GPU VMs); the 30 s window is the conservative reading.
"""

from __future__ import annotations

from skylift.cloud._protocol import MetadataError, http_request
from skylift.cloud.notice import PreemptionNotice, new_notice
from skylift.cloud.vendors import CloudVendor, KubernetesFlavour

__all__ = ["MAINTENANCE_EVENT_PATH", "PREEMPTED_PATH", "VENDOR", "poll"]

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
MAINTENANCE_EVENT_PATH = "/computeMetadata/v1/instance/maintenance-event"

_REQUEST_HEADERS = {"Metadata-Flavor": "Google"}
_HARMLESS_MAINTENANCE = frozenset({"NONE", "MIGRATE_ON_HOST_MAINTENANCE"})
_SPOT_LABEL = "cloud.google.com/gke-spot"

VENDOR = CloudVendor(
    name="gcp",
    poll_module=__name__,
    # Spot/preemptible: 30 s between the preemption notice and the hard stop.
    # https://cloud.google.com/compute/docs/instances/spot#preemption
    notice_window_s=30.0,
    poll_interval_s=1.0,  # a 30 s window needs a tight loop to leave most of it for the save
    metadata_host="http://169.254.169.254",  # what metadata.google.internal resolves to; no DNS needed
    dmi_signatures=(("sys_vendor", "Google"), ("product_name", "Google Compute Engine")),
    # https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys ("projects/N/machineTypes/NAME")
    instance_type_path="/computeMetadata/v1/instance/machine-type",
    request_headers=_REQUEST_HEADERS,
    kubernetes=KubernetesFlavour("gke", {_SPOT_LABEL: "true"},
                                 ({"key": _SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"},)),
)


def poll(base_url: str, timeout_s: float) -> PreemptionNotice | None:
    """One check of ``preempted``, then ``maintenance-event``.

    Raises:
        MetadataError: a non-200 answer, or one without ``Metadata-Flavor: Google``.
        OSError, urllib.error.HTTPError: transient failures, retried by the watcher.
    """
    if _get(base_url, PREEMPTED_PATH, timeout_s).upper() == "TRUE":
        return new_notice("gcp", "spot-termination", "instance/preempted=TRUE")
    event = _get(base_url, MAINTENANCE_EVENT_PATH, timeout_s)
    if event and event.upper() not in _HARMLESS_MAINTENANCE:
        return new_notice("gcp", "maintenance", f"instance/maintenance-event={event}")
    return None


def _get(base_url: str, path: str, timeout_s: float) -> str:
    response = http_request(base_url + path, timeout_s=timeout_s, headers=_REQUEST_HEADERS)
    if response.headers.get("Metadata-Flavor") != "Google":
        raise MetadataError(f"GET {path}: answer lacks 'Metadata-Flavor: Google'; not the GCE metadata server")
    if response.status != 200:
        raise MetadataError(f"GET {path} answered {response.status}")
    return response.text

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

__all__ = ["MAINTENANCE_EVENT_PATH", "PREEMPTED_PATH", "poll"]

PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
MAINTENANCE_EVENT_PATH = "/computeMetadata/v1/instance/maintenance-event"

_REQUEST_HEADERS = {"Metadata-Flavor": "Google"}
_HARMLESS_MAINTENANCE = frozenset({"NONE", "MIGRATE_ON_HOST_MAINTENANCE"})


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

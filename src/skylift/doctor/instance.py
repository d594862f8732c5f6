"""The cloud this machine is on (DMI, as :mod:`skylift.cloud` does) and its instance type.

The metadata service is asked only when DMI (or ``SKYLIFT_CLOUD``) names a cloud:
off-cloud a probe of 169.254.169.254 would stall for the connect timeout and touch a
network that may not be there. ``SKYLIFT_METADATA_ENDPOINT`` redirects the request
(tests use a loopback server).
"""

from __future__ import annotations

import os

from skylift.cloud.notice import detect_cloud, metadata_base_url
from skylift.cloud.vendors import check_cloud, metadata_get
from skylift.machine.facts import CloudFacts

__all__ = ["gather_cloud", "instance_type"]


def gather_cloud(*, probe_metadata: bool = True, timeout_s: float = 1.0) -> CloudFacts:
    """The detected cloud and, when ``probe_metadata``, its instance type."""
    name = detect_cloud()
    if name is None:
        return CloudFacts()
    source = "SKYLIFT_CLOUD" if os.environ.get("SKYLIFT_CLOUD", "").strip() else "dmi"
    facts = CloudFacts(name=name, source=source)
    if probe_metadata:
        try:
            facts.instance_type = instance_type(name, timeout_s=timeout_s)
        except Exception as error:  # noqa: BLE001 - any failure is a fact to report, not a crash
            facts.instance_type_error = f"{type(error).__name__}: {error}"
    return facts


def instance_type(cloud: str, *, timeout_s: float) -> str | None:
    """The vendor's name for this machine's size (``p5.48xlarge``, ``a3-highgpu-8g``), at the
    path its :class:`~skylift.cloud.vendors.CloudVendor` names, asked as its notice poller asks."""
    vendor = check_cloud(cloud, "cloud")
    path = vendor.instance_type_path
    response = metadata_get(vendor, metadata_base_url(cloud), path, timeout_s=timeout_s)
    if response.status != 200 or not response.text:
        raise RuntimeError(f"GET {path.split('?')[0]} answered {response.status}")
    # GCP answers a path with the project number in it; only the last part is the type.
    return response.text.rsplit("/", 1)[-1]

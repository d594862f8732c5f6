"""The cloud this machine is on (DMI, as :mod:`skylift.cloud` does) and its instance type.

The metadata service is asked only when DMI (or ``SKYLIFT_CLOUD``) names a cloud:
off-cloud a probe of 169.254.169.254 would stall for the connect timeout and touch a
network that may not be there. ``SKYLIFT_METADATA_ENDPOINT`` redirects the request
(tests use a loopback server).
"""

from __future__ import annotations

import os

from skylift.cloud import aliyun, aws
from skylift.cloud._protocol import http_request
from skylift.cloud.notice import detect_cloud, metadata_base_url
from skylift.machine.facts import CloudFacts

__all__ = ["INSTANCE_TYPE_PATHS", "gather_cloud"]

INSTANCE_TYPE_PATHS: dict[str, str] = {
    # https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/instancedata-data-categories.html
    "aws": "/latest/meta-data/instance-type",
    # https://cloud.google.com/compute/docs/metadata/predefined-metadata-keys ("projects/N/machineTypes/NAME")
    "gcp": "/computeMetadata/v1/instance/machine-type",
    # https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service
    "azure": "/metadata/instance/compute/vmSize?api-version=2021-02-01&format=text",
    # https://www.alibabacloud.com/help/en/ecs/user-guide/view-instance-metadata
    "aliyun": "/latest/meta-data/instance/instance-type",
    # https://www.tencentcloud.com/document/product/213/4934
    "tencent": "/latest/meta-data/instance/instance-type",
}
_HEADERS = {"gcp": {"Metadata-Flavor": "Google"}, "azure": {"Metadata": "true"}}
_SESSIONS = {"aws": aws.SESSION, "aliyun": aliyun.SESSION}  # the notice watcher's: one token cache


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
    """The vendor's name for this machine's size (``p5.48xlarge``, ``a3-highgpu-8g``)."""
    base_url, path = metadata_base_url(cloud), INSTANCE_TYPE_PATHS[cloud]
    if cloud in _SESSIONS:
        response = _SESSIONS[cloud].get(base_url, path, timeout_s=timeout_s)
    else:
        response = http_request(base_url + path, timeout_s=timeout_s, headers=_HEADERS.get(cloud))
    if response.status != 200 or not response.text:
        raise RuntimeError(f"GET {path.split('?')[0]} answered {response.status}")
    # GCP answers a path with the project number in it; only the last part is the type.
    return response.text.rsplit("/", 1)[-1]

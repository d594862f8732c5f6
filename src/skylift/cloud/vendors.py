"""The cloud registry: every vendor's facts, declared once in its own module.

Each ``skylift.cloud.<vendor>`` module ends with ``VENDOR = CloudVendor(...)``: its notice
window, poll interval, metadata host, DMI signatures, instance-type path, how a request
to its metadata service is made, the plan's interruption assumption and its managed
Kubernetes flavour. This module finds those modules by scanning the package (as
SkyPilot's ``clouds/`` registers each cloud from its own file), so a new cloud is one
new file; :func:`register` adds one from anywhere else (a plugin, a test), as fsspec's
``register_implementation`` does. Everything else (the notice watcher, ``skylift
doctor``, the config's validation, the catalog, the planner, Kubernetes spot scheduling)
reads the registry and names no vendor itself.

Vendor modules use only the standard library, so finding them costs milliseconds; the
scan runs on the first question, not at import.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from skylift.cloud import _protocol
from skylift.cloud._protocol import HttpResponse, TokenSession
from skylift.errors import SkyliftConfigError

__all__ = [
    "DEFAULT_INTERRUPTIONS_PER_HOUR",
    "SKYLIFT_SPOT_LABEL",
    "CloudVendor",
    "KubernetesFlavour",
    "check_cloud",
    "cloud_names",
    "cloud_vendor",
    "cloud_vendors",
    "kubernetes_flavours",
    "metadata_get",
    "register",
    "unregister",
]

SKYLIFT_SPOT_LABEL = "skylift.io/capacity-type"
"""For a managed Kubernetes that labels no spot node itself (ACK, TKE): skylift asks for
this label (and tolerates its taint), which the cluster's spot node pool must carry."""

DEFAULT_INTERRUPTIONS_PER_HOUR = 0.05
"""skylift's assumed spot interruptions per instance-hour where a vendor publishes no rate
(none does: AWS's Spot Instance Advisor gives monthly buckets per instance type, the
others nothing). 0.05/hour = one interruption per 20 hours of running."""


@dataclass(frozen=True)
class KubernetesFlavour:
    """A vendor's managed Kubernetes, as ``submit.kubernetes.cloud`` names it."""

    name: str
    """``eks``, ``gke``...: the value of ``submit.kubernetes.cloud``."""
    spot_node_selector: Mapping[str, str]
    """Node labels that put a pod on spot capacity."""
    spot_tolerations: tuple[Mapping[str, str], ...] = ()
    """Tolerations of the taint the vendor puts on spot nodes (none: no taint)."""


@dataclass(frozen=True)
class CloudVendor:
    """One cloud's facts. Every field is read by some other module; none repeats one."""

    name: str
    """The name in config and catalog (``preemption.cloud``, ``SKYLIFT_CLOUD``, ``provider``)."""
    poll_module: str
    """The module whose ``poll(base_url, timeout_s)`` reads a notice (the vendor's own: ``__name__``)."""
    notice_window_s: float
    """Warning the vendor documents between a notice and the machine going away; used when
    a notice carries no time of its own, for a signal's deadline and Kubernetes' grace."""
    poll_interval_s: float
    """Seconds between polls unless the config says otherwise."""
    metadata_host: str
    """``scheme://host`` of the metadata service (``SKYLIFT_METADATA_ENDPOINT`` replaces it)."""
    dmi_signatures: tuple[tuple[str, str], ...]
    """(file under /sys/class/dmi/id, text it contains, case-insensitive): this cloud."""
    instance_type_path: str
    """Metadata path that answers this machine's instance type (``skylift doctor``)."""
    request_headers: Mapping[str, str] = field(default_factory=dict)
    """Headers every metadata request carries (``Metadata-Flavor: Google``)."""
    session: TokenSession | None = None
    """IMDSv2-style tokens every metadata request needs (shared with the notice poller)."""
    interruptions_per_hour: float = DEFAULT_INTERRUPTIONS_PER_HOUR
    """``skylift plan``'s spot interruption rate, until the vendor publishes one."""
    kubernetes: KubernetesFlavour | None = None
    """Its managed Kubernetes, for spot node scheduling and the pods' grace period."""


_registered: dict[str, CloudVendor] = {}
_scanned = threading.Event()
_lock = threading.RLock()


def register(vendor: CloudVendor, *, replace: bool = False) -> CloudVendor:
    """Add a cloud that lives outside this package (a plugin's module, a test's).

    Raises:
        ValueError: the name (or its Kubernetes flavour) is taken and ``replace`` is false.
    """
    with _lock:
        _scan()
        taken = _registered.get(vendor.name)
        if taken is not None and not replace:
            raise ValueError(f"cloud {vendor.name!r} is already registered (by {taken.poll_module})")
        flavour = vendor.kubernetes.name if vendor.kubernetes else None
        clash = [other.name for other in _registered.values() if other.name != vendor.name and other.kubernetes
                 and other.kubernetes.name == flavour]  # fmt: skip
        if clash:
            raise ValueError(f"Kubernetes flavour {flavour!r} of {vendor.name!r} is already {clash[0]}'s")
        _registered[vendor.name] = vendor
    return vendor


def unregister(name: str) -> None:
    """Remove a cloud added with :func:`register` (tests clean up with it)."""
    with _lock:
        _registered.pop(name, None)


def _scan() -> None:
    """Import every module of :mod:`skylift.cloud` that declares ``VENDOR``, once."""
    with _lock:
        if _scanned.is_set():
            return
        _scanned.set()
        package = importlib.import_module("skylift.cloud")
        for module_info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
            if module_info.name.startswith("_") or module_info.ispkg:
                continue
            module = importlib.import_module(f"skylift.cloud.{module_info.name}")
            vendor = getattr(module, "VENDOR", None)
            if isinstance(vendor, CloudVendor):
                _registered.setdefault(vendor.name, vendor)


def cloud_vendors() -> tuple[CloudVendor, ...]:
    """Every registered cloud, in name order."""
    with _lock:
        _scan()
        return tuple(sorted(_registered.values(), key=lambda vendor: vendor.name))


def cloud_names() -> tuple[str, ...]:
    return tuple(vendor.name for vendor in cloud_vendors())


def cloud_vendor(name: str) -> CloudVendor | None:
    with _lock:
        _scan()
        return _registered.get(name)


def check_cloud(name: str, source: str) -> CloudVendor:
    """The cloud called ``name``, or an error naming ``source`` (the field or variable) and the choices.

    Raises:
        SkyliftConfigError: (a ``ValueError``) no such cloud is registered.
    """
    vendor = cloud_vendor(name)
    if vendor is None:
        raise SkyliftConfigError(f"{source}={name!r} is not a known cloud; use one of: {', '.join(cloud_names())}")
    return vendor


def kubernetes_flavours() -> dict[str, CloudVendor]:
    """Managed Kubernetes flavour (``eks``) to its cloud."""
    return {vendor.kubernetes.name: vendor for vendor in cloud_vendors() if vendor.kubernetes is not None}


def metadata_get(vendor: CloudVendor, base_url: str, path: str, *, timeout_s: float) -> HttpResponse:
    """``GET base_url + path`` the way ``vendor``'s metadata service wants it (headers, token).

    Like every metadata request, it goes through :func:`skylift.cloud._protocol.http_request`
    (looked up at call time, so a test can refuse there).
    """
    if vendor.session is not None:
        return vendor.session.get(base_url, path, timeout_s=timeout_s)
    return _protocol.http_request(base_url + path, timeout_s=timeout_s, headers=vendor.request_headers)

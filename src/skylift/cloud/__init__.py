"""Clouds: one module per vendor, the registry that gathers them, preemption notices.

Each vendor module (``skylift.cloud.<vendor>``) speaks its vendor's metadata protocol and
declares its facts (``VENDOR``: notice window, poll interval, metadata host, DMI
signatures, instance-type path, plan and Kubernetes facts); ``vendors`` finds them, so a
new cloud is one new file. ``notice`` holds the shared part (the notice record, cloud
detection, the polling thread and the signal handlers). Nothing is imported here so
that ``import skylift.cloud`` stays free.
"""

from __future__ import annotations

__all__: list[str] = []

"""Cloud preemption notices: one watcher, one small module per vendor.

``notice`` holds the shared part (the notice record, cloud detection, the polling
thread and the signal handlers); ``aws``, ``gcp``, ``azure``, ``aliyun`` and
``tencent`` each speak one vendor's metadata protocol and nothing else. Nothing is
imported here so that ``import skylift.cloud`` stays free.
"""

from __future__ import annotations

__all__: list[str] = []

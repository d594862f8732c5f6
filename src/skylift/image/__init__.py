"""Image: the container a job runs in on a platform (``skylift dockerfile``).

:mod:`~skylift.image.dockerfile` writes a Dockerfile for the user's project, its
entrypoint and ``.dockerignore``, sized from the run config (shared memory from the data
loader's workers).
"""

from __future__ import annotations

__all__: list[str] = []

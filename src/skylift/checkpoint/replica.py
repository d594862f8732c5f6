"""One node's share of a checkpoint, sent to the next node's memory over TCP.

Each node's memory tier (memory_tier.py) runs a :class:`ReplicaReceiver` in its leader
process and, after each local commit, sends the step's files it holds to the next node
in ring order (:func:`send_step`). A plain TCP connection rather than a second gloo
group: a collective needs every rank to join, while this is one node talking to one
other beside training, and the sender streams each file straight from tmpfs in
pieces (benchmarks/memory_tier.py measures it).

One connection per step::

    sender   -> receiver   {"token", "step", "files": {name: size}, "manifest": size}\\n
    receiver -> sender     {"need": [names it does not hold yet]}\\n
    sender   -> receiver   the needed files' bytes in that order, then the manifest's
    receiver -> sender     {"stored": true}\\n  or  {"error": "..."}\\n

The receiver writes each file through a temporary that is renamed once whole (a sender
killed mid-file leaves nothing visible), and the manifest only where the node has none
yet. Files are not hashed here: a resume verifies every file against the manifest
anyway, and one that does not verify is read from the next place that has it.

The token is the receiver's own random secret, given to its peer over the job's process
group: the receiver answers nothing to a connection that does not present it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from skylift.checkpoint.faults import fault_point
from skylift.checkpoint.manifest import MANIFEST, step_folder
from skylift.checkpoint.mirror import PIECE_BYTES
from skylift.storage.local import LocalStore

__all__ = ["ReplicaError", "ReplicaPeer", "ReplicaReceiver", "node_address", "send_step"]

log = logging.getLogger("skylift")

_HEADER_LIMIT_BYTES = 16 * 2**20
"""A header line longer than this is not a sender of ours."""


class ReplicaError(Exception):
    """A step's files did not reach the peer's memory."""


@dataclass(frozen=True)
class ReplicaPeer:
    """Where a node's receiver listens, and the secret it expects."""

    address: str
    port: int
    token: str

    def describe(self) -> str:
        return f"{self.address}:{self.port}"


def node_address(master_address: str) -> str:
    """This node's address on the interface that reaches ``master_address`` (the job's
    rendezvous host): the one its peers reach it on. A UDP connect sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((master_address, 9))
        return str(probe.getsockname()[0])


class ReplicaReceiver:
    """Accepts the previous node's step files into ``store`` (this node's memory tier).

    Args:
        store: the tier's folder; files land in its ``step-N/`` folders.
        address, port: where to listen (port 0: any free port).
        timeout_s: the longest a connection may stay silent before it is dropped.
    """

    def __init__(self, store: LocalStore, address: str, port: int, *, timeout_s: float) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.token = secrets.token_hex(16)
        self._listener = socket.create_server((address, port), backlog=4)
        self.peer = ReplicaPeer(address, self._listener.getsockname()[1], self.token)
        self.received_steps: list[int] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="skylift-replica-receiver", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):  # not connected: close alone ends accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            # The file object holds the socket open: both close, or the sender never sees the end.
            with connection, connection.makefile("rb") as reader:
                connection.settimeout(self.timeout_s)
                try:
                    self._receive(connection, reader)
                except Exception as failure:  # noqa: BLE001 - one bad transfer must not end the receiver
                    log.warning("replica from a peer node not stored: %s: %s", type(failure).__name__, failure)

    def _receive(self, connection: socket.socket, reader: Any) -> None:
        header = json.loads(reader.readline(_HEADER_LIMIT_BYTES) or b"{}")
        if not secrets.compare_digest(str(header.get("token", "")), self.token):
            raise ReplicaError("a connection without this node's token; ignored")
        step = int(header["step"])
        sizes = {str(name): int(size) for name, size in header["files"].items()}
        folder = step_folder(step)
        for name in sizes:
            _check_name(name)
        need = [name for name in sizes if not self.store.exists(f"{folder}/{name}")]
        connection.sendall(json.dumps({"need": need}).encode() + b"\n")
        try:
            for name in need:
                self.store.write_chunks(f"{folder}/{name}", _exactly(reader, sizes[name]))
            manifest = b"".join(_exactly(reader, int(header["manifest"]))())
            if not self.store.exists(f"{folder}/{MANIFEST}"):  # this node's own commit may not have written it yet
                self.store.write_bytes(f"{folder}/{MANIFEST}", manifest)
        except Exception as failure:
            connection.sendall(json.dumps({"error": f"{type(failure).__name__}: {failure}"}).encode() + b"\n")
            raise
        self.received_steps.append(step)
        connection.sendall(b'{"stored": true}\n')


def send_step(
    store: LocalStore,
    step: int,
    manifest: bytes,
    names: list[str],
    peer: ReplicaPeer,
    *,
    timeout_s: float,
    check: Callable[[], None] = lambda: None,
    rank: int = 0,
) -> int:
    """Send ``names`` of ``step`` from ``store`` to ``peer`` (those it lacks), then the
    manifest; return the bytes sent. ``check`` runs between pieces (the manager's cancel).

    Raises:
        ReplicaError: the peer could not be reached, refused or did not store them.
    """
    folder = step_folder(step)
    sizes = {name: store.size(f"{folder}/{name}") for name in names}
    sent = 0
    try:
        with socket.create_connection((peer.address, peer.port), timeout=timeout_s) as connection, \
                connection.makefile("rb") as reader:
            header = {"token": peer.token, "step": step, "files": sizes, "manifest": len(manifest)}
            connection.sendall(json.dumps(header).encode() + b"\n")
            need = json.loads(reader.readline(_HEADER_LIMIT_BYTES) or b"{}").get("need")
            if need is None:
                raise ReplicaError(f"the peer at {peer.describe()} did not answer the step's header")
            for name in need:
                with open(store.path(f"{folder}/{name}"), "rb") as handle:
                    while piece := handle.read(PIECE_BYTES):
                        check()
                        connection.sendall(piece)
                        sent += len(piece)
                        fault_point("during_replication", step=step, rank=rank)
            connection.sendall(manifest)
            answer = json.loads(reader.readline(_HEADER_LIMIT_BYTES) or b"{}")
    except OSError as failure:
        raise ReplicaError(f"step {step} to the peer at {peer.describe()}: {type(failure).__name__}: {failure}") \
            from failure
    if not answer.get("stored"):
        problem = answer.get("error", "no answer")
        raise ReplicaError(f"the peer at {peer.describe()} did not store step {step}: {problem}")
    return sent


def _exactly(reader: Any, size: int) -> Callable[[], Iterator[bytes]]:
    """The next ``size`` bytes of the connection, in pieces; a short stream raises (the
    sender died): the file's temporary is then removed, nothing published."""

    def pieces() -> Iterator[bytes]:
        left = size
        while left:
            piece = reader.read(min(left, PIECE_BYTES))
            if not piece:
                raise ReplicaError(f"the sender stopped with {left} of {size} bytes to come")
            left -= len(piece)
            yield piece

    return pieces


def _check_name(name: str) -> None:
    """A file name of a step folder: no folder climbing, no absolute path."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or ".." in parts or "\\" in name:
        raise ReplicaError(f"file name {name!r} refused")

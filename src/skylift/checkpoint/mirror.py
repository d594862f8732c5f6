"""Step folders on this node's disk copied to a store, by the commit rule, and back.

Both copies skylift keeps of a checkpoint on local disk go through here: the node-local
tier in front of ``checkpoint.root`` (tiers.py) and a framework's sealed checkpoint
folders in front of their mirror (integrations/checkpoints.py). Either way the files go
first, each checked against its manifest entry on the way, and the manifest last, so a
copy is complete and verified or invisible; an old copy loses its manifest before its
files, so a half-deleted one reads as torn; and a restore streams every file through a
temporary that is renamed only once its sha256 matches.

Layout, on both sides, for a prefix ``step-`` (or a framework's ``checkpoint-``)::

    step-120/
      ...files...
      manifest.json     written last
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from skylift.checkpoint.manifest import MANIFEST, CorruptCheckpointError, Manifest, hashing
from skylift.storage import StorageNotFoundError, Store
from skylift.storage.base import Chunks
from skylift.storage.local import LocalStore

__all__ = ["PIECE_BYTES", "FolderMirror", "download_verified", "file_pieces", "hash_file"]

PIECE_BYTES = 8 * 2**20
"""Bytes read, hashed or downloaded at a time: a checkpoint file never has to fit in memory."""


def file_pieces(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while piece := handle.read(PIECE_BYTES):
            yield piece


def hash_file(path: Path, *, sync: bool = False) -> dict[str, Any]:
    """A file's manifest entry (size and sha256), read in pieces; ``sync``: fsync it too."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while piece := handle.read(PIECE_BYTES):
            digest.update(piece)
            size += len(piece)
        if sync:
            # Its writer went through the page cache; the manifest must not outlive its files.
            os.fsync(handle.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


class FolderMirror:
    """The ``PREFIX<step>`` folders of a local folder and their copies in a store.

    Args:
        local: the folder on this node's disk.
        remote: the store the folders are copied to.
        prefix: the folder name before the step (``step-``, ``checkpoint-``).
    """

    def __init__(self, local: str | os.PathLike[str], remote: Store, prefix: str) -> None:
        self.local = LocalStore(Path(local))
        self.remote = remote
        self.prefix = prefix
        self._pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")

    def folder_name(self, step: int) -> str:
        return f"{self.prefix}{step}"

    def step_of(self, name: str) -> int | None:
        """The step of a folder named ``PREFIX<step>``; None for any other name."""
        match = self._pattern.match(name)
        return int(match.group(1)) if match else None

    def upload_files(self, step: int, entries: dict[str, dict[str, Any]],
                     wrap: Callable[[Chunks], Chunks] = lambda make: make) -> None:
        """Copy the listed files of ``step`` to the store, each checked against its entry.

        ``wrap`` sees every file's pieces on their way (the checkpoint manager stops a
        cancelled upload with it). The manifest is not copied: see :meth:`upload`.

        Raises:
            CorruptCheckpointError: a local file changed since its entry was taken.
            StorageError: the store failed past its retries.
        """
        folder = self.folder_name(step)
        for name, expected in entries.items():
            key = f"{folder}/{name}"
            path = self.local.path(key)
            hashed, actual = hashing(wrap(functools.partial(file_pieces, path)))
            self.remote.write_chunks(key, hashed)
            if actual != expected:
                raise CorruptCheckpointError(
                    f"{self.local.describe(key)} changed after it was sealed "
                    f"(its manifest entry says sha256 {expected['sha256']}; read {actual.get('sha256')})"
                )

    def upload(self, step: int, manifest: Manifest, *, keep: int) -> None:
        """Copy a complete folder to the store, files first and the manifest last; then keep
        only the ``keep`` newest complete copies there (see :meth:`prune_remote`)."""
        self.upload_files(step, manifest.files)
        self.remote.write_bytes(f"{self.folder_name(step)}/{MANIFEST}", manifest.encode())
        self.prune_remote(newest=step, keep=keep)

    def remote_steps(self) -> set[int]:
        """Steps whose copy in the store has a manifest (not yet verified)."""
        steps = set()
        for key in self.remote.list():
            head, _, rest = key.partition("/")
            step = self.step_of(head)
            if step is not None and rest == MANIFEST:
                steps.add(step)
        return steps

    def remote_manifest(self, step: int) -> Manifest:
        """The manifest of ``step``'s copy in the store, once it reads and every file it
        lists is there at its size (the hashes are checked as a restore reads them).

        Raises:
            CorruptCheckpointError: missing, another step's, or a file missing or of another size.
        """
        key = f"{self.folder_name(step)}/{MANIFEST}"
        try:
            manifest = Manifest.decode(self.remote.read_bytes(key), self.remote.describe(key))
        except StorageNotFoundError:
            raise CorruptCheckpointError(f"{self.remote.describe(key)} is missing") from None
        if manifest.step != step:
            raise CorruptCheckpointError(f"{self.remote.describe(key)} is for step {manifest.step}")
        for file_name, expected in manifest.files.items():
            file_key = f"{self.folder_name(step)}/{file_name}"
            try:
                size = self.remote.size(file_key)
            except StorageNotFoundError:
                raise CorruptCheckpointError(f"{self.remote.describe(file_key)} is listed but missing") from None
            if size != expected["size"]:
                raise CorruptCheckpointError(
                    f"{self.remote.describe(file_key)} holds {size} bytes; the manifest says {expected['size']}")
        return manifest

    def prune_remote(self, *, newest: int, keep: int) -> None:
        """Keep the ``keep`` newest complete copies up to ``newest``; older folders (complete or torn) go."""
        complete = sorted(step for step in self.remote_steps() if step <= newest)
        if len(complete) <= keep:
            return
        oldest_kept = complete[-keep]
        doomed = [key for key in self.remote.list()
                  if (step := self.step_of(key.partition("/")[0])) is not None and step < oldest_kept]  # fmt: skip
        # Manifests first: a folder half deleted must read as torn, never as complete.
        self.remote.delete([key for key in doomed if key.endswith(f"/{MANIFEST}")])
        self.remote.delete([key for key in doomed if not key.endswith(f"/{MANIFEST}")])

    def restore(self, step: int, manifest: Manifest) -> Path:
        """Copy ``step`` from the store into the local folder, each file verified, the manifest last.

        Raises:
            CorruptCheckpointError: a file in the store does not match its manifest.
        """
        folder = self.folder_name(step)
        target = self.local.path(folder)
        (target / MANIFEST).unlink(missing_ok=True)  # a folder being rewritten is not complete
        target.mkdir(parents=True, exist_ok=True)
        for file_name, expected in manifest.files.items():
            download_verified(self.remote, f"{folder}/{file_name}", expected, target / file_name)
        self.local.write_bytes(f"{folder}/{MANIFEST}", manifest.encode())
        return target


def download_verified(store: Store, key: str, expected: dict[str, Any], target: Path) -> None:
    """Stream ``key`` into ``target`` through a temporary file, renamed only once its sha256 matches."""
    digest, size = hashlib.sha256(), 0
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=".skylift-tmp-", dir=target.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            while size < expected["size"]:
                piece = store.read_range(key, size, min(size + PIECE_BYTES, expected["size"]))
                if not piece:
                    break
                digest.update(piece)
                handle.write(piece)
                size += len(piece)
            handle.flush()
            os.fsync(handle.fileno())
        actual = {"size": size, "sha256": digest.hexdigest()}
        if actual != expected:
            raise CorruptCheckpointError(
                f"{store.describe(key)} does not match its manifest: expected {expected['size']} bytes, sha256 "
                f"{expected['sha256']}; found {size} bytes, sha256 {actual['sha256']}"
            )
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)

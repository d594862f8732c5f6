"""A framework's own checkpoint folders under skylift's commit rule.

The Hugging Face Trainer and Lightning write checkpoints in formats of their own;
skylift never reads those formats. It *seals* a folder once the framework is done with
it: ``manifest.json`` (skylift's checkpoint manifest: every file with its size and
sha256) is written last, atomically. A folder without a manifest that verifies is
torn, and resume skips it. A mirror (an object store or another folder) receives the
files first and the manifest last, so there too a checkpoint is visible only when
complete; a restore copies a mirrored checkpoint back onto local disk by the same rule.

Layout, for a prefix ``checkpoint-`` (the Trainer's) or ``step-`` (Lightning's)::

    DIRECTORY/checkpoint-120/
      model.safetensors, optimizer.pt, ...   the framework's own files
      manifest.json                          written last by skylift
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skylift.checkpoint.manifest import MANIFEST, CorruptCheckpointError, Manifest, hashing
from skylift.storage import StorageError, StorageNotFoundError, Store
from skylift.storage.local import LocalStore

__all__ = ["FolderCheckpoints", "MirroredStep", "remove_folder", "seal", "unseal", "verify_folder"]

log = logging.getLogger("skylift")

_PIECE_BYTES = 8 * 2**20
"""Bytes read or downloaded at a time: a checkpoint file never has to fit in memory."""


def _files_of(folder: Path) -> list[str]:
    """Every file under ``folder`` as a ``/``-separated relative name, manifest and temporaries left out."""
    names = []
    for parent, _, files in os.walk(folder):
        for name in files:
            if name == MANIFEST or name.startswith(".skylift-tmp-"):
                continue
            names.append(Path(parent, name).relative_to(folder).as_posix())
    return sorted(names)


def _hash_file(path: Path, *, sync: bool = False) -> dict[str, Any]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while piece := handle.read(_PIECE_BYTES):
            digest.update(piece)
            size += len(piece)
        if sync:
            # The framework wrote through the page cache; the manifest must not outlive its files.
            os.fsync(handle.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def seal(folder: Path, step: int, world_size: int) -> Manifest:
    """Write ``folder``'s manifest (every file's size and sha256), last and atomically.

    Call once every rank has finished writing into ``folder``.

    Raises:
        CorruptCheckpointError: the folder is missing or holds no file.
    """
    if not folder.is_dir():
        raise CorruptCheckpointError(f"{folder} does not exist: the framework wrote no checkpoint there")
    names = _files_of(folder)
    if not names:
        raise CorruptCheckpointError(f"{folder} holds no file to seal")
    manifest = Manifest.create(step, world_size, {name: _hash_file(folder / name, sync=True) for name in names})
    LocalStore(folder).write_bytes(MANIFEST, manifest.encode())
    return manifest


def unseal(folder: Path) -> None:
    """Remove a manifest that a framework is about to write over (the folder is being rewritten)."""
    (folder / MANIFEST).unlink(missing_ok=True)


def verify_folder(folder: Path, step: int) -> Manifest:
    """The folder's manifest, once every file it lists matches it (size and sha256).

    Raises:
        CorruptCheckpointError: no manifest, another step's, or a file that differs, naming it.
    """
    path = folder / MANIFEST
    try:
        manifest = Manifest.decode(path.read_bytes(), str(path))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{folder} has no {MANIFEST}: not complete") from None
    if manifest.step != step:
        raise CorruptCheckpointError(f"{path} is for step {manifest.step}, not {step}")
    for name, expected in manifest.files.items():
        try:
            actual = _hash_file(folder / name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{folder / name} is listed in the manifest but missing") from None
        if actual != expected:
            raise CorruptCheckpointError(
                f"{folder / name} does not match the manifest: expected {expected['size']} bytes, sha256 "
                f"{expected['sha256']}; found {actual['size']} bytes, sha256 {actual['sha256']}"
            )
    return manifest


@dataclass(frozen=True)
class MirroredStep:
    step: int
    manifest: Manifest


class FolderCheckpoints:
    """The ``PREFIX<step>`` folders of one directory, and their mirror in a store.

    Args:
        directory: the local folder the framework writes its checkpoints into.
        prefix: the folder name before the step: ``checkpoint-`` or ``step-``.
        mirror: where sealed checkpoints are copied (``None``: nowhere).
        keep: complete checkpoints to keep in the mirror (older ones are deleted only
            after a newer one committed there).
    """

    def __init__(self, directory: str | os.PathLike[str], prefix: str, *, mirror: Store | None = None,
                 keep: int = 3) -> None:
        if keep < 2:
            raise ValueError(f"keep must be at least 2 (a corrupt newest checkpoint must not leave none), got {keep}")
        self.directory = Path(directory)
        self.prefix = prefix
        self.mirror = mirror
        self.keep = keep
        self._pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")

    def folder(self, step: int) -> Path:
        return self.directory / f"{self.prefix}{step}"

    def local_steps(self) -> list[int]:
        """Steps with a folder here, complete or not, newest first."""
        if not self.directory.is_dir():
            return []
        steps = (self._step_of(entry.name) for entry in self.directory.iterdir() if entry.is_dir())
        return sorted((step for step in steps if step is not None), reverse=True)

    def newest_local(self) -> int | None:
        """The newest step whose local folder verifies; torn ones are skipped with a warning naming them."""
        for step in self.local_steps():
            try:
                verify_folder(self.folder(step), step)
                return step
            except (CorruptCheckpointError, OSError) as error:
                log.warning("skipping checkpoint %s: %s", self.folder(step), error)
        return None

    def prune_local(self, newest: int) -> None:
        """Keep the ``keep`` newest complete local steps up to ``newest``; older folders go.

        For folders skylift itself writes (Lightning's); the Trainer rotates its own."""
        kept = 0
        for step in self.local_steps():
            if step > newest:
                continue
            if kept >= self.keep:
                remove_folder(self.folder(step))
                continue
            # The manifest's presence, not a re-hash of every kept checkpoint at every save.
            if (self.folder(step) / MANIFEST).is_file():
                kept += 1
            elif kept:  # torn, and older than a complete one: nothing will resume from it
                remove_folder(self.folder(step))

    # -- the mirror ---------------------------------------------------------------

    def upload(self, step: int, manifest: Manifest) -> None:
        """Copy a sealed folder to the mirror: its files first, the manifest last; then prune.

        Raises:
            CorruptCheckpointError: a file changed since it was sealed.
            StorageError: the store failed past its retries.
        """
        assert self.mirror is not None, "upload() needs a mirror"
        name = f"{self.prefix}{step}"
        for file_name, expected in manifest.files.items():
            chunks, written = hashing(lambda path=self.folder(step) / file_name: _read_pieces(path))
            self.mirror.write_chunks(f"{name}/{file_name}", chunks)
            if written != expected:
                raise CorruptCheckpointError(f"{self.folder(step) / file_name} changed after it was sealed")
        self.mirror.write_bytes(f"{name}/{MANIFEST}", manifest.encode())
        self._prune_mirror(step)

    def newest_mirrored(self) -> MirroredStep | None:
        """The newest step in the mirror whose manifest reads and lists files of the stated sizes.

        The files' hashes are checked as they are restored (:meth:`restore`)."""
        if self.mirror is None:
            return None
        for step in sorted(self._mirrored_steps(), reverse=True):
            try:
                return MirroredStep(step, self._mirrored_manifest(step))
            except (CorruptCheckpointError, StorageError) as error:
                log.warning("skipping checkpoint %s: %s", self.mirror.describe(f"{self.prefix}{step}"), error)
        return None

    def restore(self, mirrored: MirroredStep) -> Path:
        """Copy a mirrored checkpoint into the local folder, each file verified, the manifest last.

        Raises:
            CorruptCheckpointError: a file in the mirror does not match its manifest.
        """
        assert self.mirror is not None, "restore() needs a mirror"
        folder = self.folder(mirrored.step)
        unseal(folder)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"{self.prefix}{mirrored.step}"
        for file_name, expected in mirrored.manifest.files.items():
            _download_verified(self.mirror, f"{name}/{file_name}", expected, folder / file_name)
        LocalStore(folder).write_bytes(MANIFEST, mirrored.manifest.encode())
        return folder

    def _mirrored_steps(self) -> set[int]:
        assert self.mirror is not None
        steps = set()
        for key in self.mirror.list():
            head, _, rest = key.partition("/")
            step = self._step_of(head)
            if step is not None and rest == MANIFEST:
                steps.add(step)
        return steps

    def _mirrored_manifest(self, step: int) -> Manifest:
        assert self.mirror is not None
        key = f"{self.prefix}{step}/{MANIFEST}"
        try:
            manifest = Manifest.decode(self.mirror.read_bytes(key), self.mirror.describe(key))
        except StorageNotFoundError:
            raise CorruptCheckpointError(f"{self.mirror.describe(key)} is missing") from None
        if manifest.step != step:
            raise CorruptCheckpointError(f"{self.mirror.describe(key)} is for step {manifest.step}")
        for file_name, expected in manifest.files.items():
            file_key = f"{self.prefix}{step}/{file_name}"
            try:
                size = self.mirror.size(file_key)
            except StorageNotFoundError:
                raise CorruptCheckpointError(f"{self.mirror.describe(file_key)} is listed but missing") from None
            if size != expected["size"]:
                raise CorruptCheckpointError(
                    f"{self.mirror.describe(file_key)} holds {size} bytes; the manifest says {expected['size']}")
        return manifest

    def _prune_mirror(self, newest: int) -> None:
        """Keep the ``keep`` newest complete steps; older folders (complete or torn) go."""
        assert self.mirror is not None
        complete = sorted(step for step in self._mirrored_steps() if step <= newest)
        if len(complete) <= self.keep:
            return
        oldest_kept = complete[-self.keep]
        doomed = [key for key in self.mirror.list()
                  if (step := self._step_of(key.partition("/")[0])) is not None and step < oldest_kept]  # fmt: skip
        # Manifests first: a folder half deleted must read as torn, never as complete.
        self.mirror.delete([key for key in doomed if key.endswith(f"/{MANIFEST}")])
        self.mirror.delete([key for key in doomed if not key.endswith(f"/{MANIFEST}")])

    def _step_of(self, name: str) -> int | None:
        match = self._pattern.match(name)
        return int(match.group(1)) if match else None


def _read_pieces(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while piece := handle.read(_PIECE_BYTES):
            yield piece


def _download_verified(store: Store, key: str, expected: dict[str, Any], target: Path) -> None:
    """Stream ``key`` into ``target`` through a temporary file, renamed only once its sha256 matches."""
    digest, size = hashlib.sha256(), 0
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=".skylift-tmp-", dir=target.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            while size < expected["size"]:
                piece = store.read_range(key, size, min(size + _PIECE_BYTES, expected["size"]))
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


def remove_folder(folder: Path) -> None:
    """Delete a local checkpoint folder, manifest first (so a half-deleted folder reads as torn)."""
    unseal(folder)
    shutil.rmtree(folder, ignore_errors=True)

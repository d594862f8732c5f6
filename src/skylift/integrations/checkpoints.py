"""A framework's own checkpoint folders under skylift's commit rule.

The Hugging Face Trainer and Lightning write checkpoints in formats of their own;
skylift never reads those formats. It *seals* a folder once the framework is done with
it: ``manifest.json`` (skylift's checkpoint manifest: every file with its size and
sha256) is written last, atomically. A folder without a manifest that verifies is
torn, and resume skips it. A mirror (an object store or another folder) receives the
files first and the manifest last, so there too a checkpoint is visible only when
complete; a restore copies a mirrored checkpoint back onto local disk by the same rule
(the copying is checkpoint/mirror.py's, which the node-local tier uses too).

Layout, for a prefix ``checkpoint-`` (the Trainer's) or ``step-`` (Lightning's)::

    DIRECTORY/checkpoint-120/
      model.safetensors, optimizer.pt, ...   the framework's own files
      manifest.json                          written last by skylift
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from skylift.checkpoint.manifest import MANIFEST, CorruptCheckpointError, Manifest
from skylift.checkpoint.mirror import FolderMirror, hash_file
from skylift.storage import StorageError, Store
from skylift.storage.local import LocalStore

__all__ = ["FolderCheckpoints", "MirroredStep", "remove_folder", "seal", "unseal", "verify_folder"]

log = logging.getLogger("skylift")


def _files_of(folder: Path) -> list[str]:
    """Every file under ``folder`` as a ``/``-separated relative name, manifest and temporaries left out."""
    names = []
    for parent, _, files in os.walk(folder):
        for name in files:
            if name == MANIFEST or name.startswith(".skylift-tmp-"):
                continue
            names.append(Path(parent, name).relative_to(folder).as_posix())
    return sorted(names)


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
    manifest = Manifest.create(step, world_size, {name: hash_file(folder / name, sync=True) for name in names})
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
            actual = hash_file(folder / name)
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
        self._mirror = FolderMirror(self.directory, mirror, prefix) if mirror is not None else None

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

    # -- the mirror (checkpoint/mirror.py: files first, the manifest last) ---------

    def upload(self, step: int, manifest: Manifest) -> None:
        """Copy a sealed folder to the mirror: its files first, the manifest last; then prune.

        Raises:
            CorruptCheckpointError: a file changed since it was sealed.
            StorageError: the store failed past its retries.
        """
        assert self._mirror is not None, "upload() needs a mirror"
        self._mirror.upload(step, manifest, keep=self.keep)

    def newest_mirrored(self) -> MirroredStep | None:
        """The newest step in the mirror whose manifest reads and lists files of the stated sizes.

        The files' hashes are checked as they are restored (:meth:`restore`)."""
        if self._mirror is None:
            return None
        for step in sorted(self._mirror.remote_steps(), reverse=True):
            try:
                return MirroredStep(step, self._mirror.remote_manifest(step))
            except (CorruptCheckpointError, StorageError) as error:
                log.warning("skipping checkpoint %s: %s", self._mirror.remote.describe(f"{self.prefix}{step}"), error)
        return None

    def restore(self, mirrored: MirroredStep) -> Path:
        """Copy a mirrored checkpoint into the local folder, each file verified, the manifest last.

        Raises:
            CorruptCheckpointError: a file in the mirror does not match its manifest.
        """
        assert self._mirror is not None, "restore() needs a mirror"
        self._mirror.restore(mirrored.step, mirrored.manifest)
        return self.folder(mirrored.step)

    def _step_of(self, name: str) -> int | None:
        match = self._pattern.match(name)
        return int(match.group(1)) if match else None


def remove_folder(folder: Path) -> None:
    """Delete a local checkpoint folder, manifest first (so a half-deleted folder reads as torn)."""
    unseal(folder)
    shutil.rmtree(folder, ignore_errors=True)

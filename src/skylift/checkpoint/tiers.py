"""A node-local copy of every checkpoint in front of an object-store root.

With ``checkpoint.local_root`` set, a save commits twice: first to a folder on this
node's disk (seconds), then, from those files, to ``checkpoint.root`` (minutes for a
large model). Each commit is the same protocol (files, then a manifest written last),
so each copy is complete and verified or invisible on its own.

Resume reads every file from the local copy when that copy verifies against the
manifest, and from the root otherwise. On a node other than rank 0's, the local copy
holds only that node's ranks' files (the manifest lists all of them), so the rest come
from the root. That makes a crash or an OOM restart on the same machine resume without
downloading, and keeps a checkpoint whose upload a preemption cut short where the disk
outlives the VM (a stopped or deallocated spot VM).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from skylift.checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpointError,
    Manifest,
    read_manifest,
    step_folder,
    uncommitted_steps,
    verified_file,
)
from skylift.checkpoint.mirror import FolderMirror
from skylift.errors import SkyliftConfigError
from skylift.storage import StorageError, Store
from skylift.storage.base import Chunks
from skylift.storage.local import LocalStore

__all__ = ["LocalTier", "manifest_with_fallback", "read_with_fallback"]

log = logging.getLogger("skylift")


class LocalTier:
    """The local copies of one run's checkpoints on this node.

    Args:
        local_root: ``checkpoint.local_root``.
        remote: the checkpoint root the copies belong to (its URL names the subfolder,
            so two runs sharing a local folder never see each other's checkpoints).
        node_leader: this process tends the node's folder (local rank 0).
    """

    setting = "checkpoint.local_root"
    copy_name = "local copy"

    keep: int | None = None
    """Committed steps kept here; None: ``checkpoint.keep``, as at the root."""

    replicates = False
    """Whether each local commit goes on to a peer node (the memory tier's)."""

    def __init__(self, local_root: str, remote: Store, *, node_leader: bool) -> None:
        if "://" in local_root:
            raise SkyliftConfigError(
                f"{self.setting}: {local_root!r} is a URL; it must be a folder on this node"
            )
        run_key = hashlib.sha256(remote.url.encode()).hexdigest()[:16]
        # The root's manifest is the manager's commit, after every rank's upload: this
        # tier copies files only (the same copy as a framework checkpoint's mirror).
        self._mirror = FolderMirror(Path(local_root) / run_key, remote, "step-")
        self.store: LocalStore = self._mirror.local
        self.remote = remote
        self.node_leader = node_leader

    def upload(self, step: int, entries: dict[str, dict], wrap: Callable[[Chunks], Chunks] = lambda make: make) -> None:
        """Copy this rank's files of ``step`` to the root, checking each against its entry.

        ``wrap`` sees every file's pieces on their way (the manager stops a cancelled
        upload with it).

        Raises:
            CorruptCheckpointError: a local file changed since it was written.
        """
        self._mirror.upload_files(step, entries, wrap)

    def replicate(self, step: int, manifest: bytes, check: Callable[[], None], rank: int) -> int:
        """Send this node's files of ``step`` on to a peer node (tiers that replicate)."""
        raise NotImplementedError(f"{type(self).__name__} does not replicate")

    def write_manifest(self, step: int, manifest: bytes) -> None:
        """The local commit point on a node other than rank 0's (rank 0 commits through the manager)."""
        self.store.write_bytes(f"{step_folder(step)}/{MANIFEST}", manifest)

    def drop_mismatches(self, step: int, manifest: bytes, written: dict[str, dict]) -> list[str]:
        """Delete this node's copies of replicated files that differ from rank 0's
        (replicas that diverged): a resume then reads them from the root."""
        listed = Manifest.decode(manifest, self.store.describe(step_folder(step))).files
        differing = sorted(name for name, entry in written.items() if listed.get(name) != entry)
        if differing:
            log.warning(
                "step %d: this node's %s differ from rank 0's (replicas diverged); removed from the local copy, "
                "a resume reads them from the root",
                step, ", ".join(differing),
            )  # fmt: skip
            self.store.delete([f"{step_folder(step)}/{name}" for name in differing])
        return differing

    def discard(self, step: int) -> None:
        try:
            self.store.delete_prefix(step_folder(step))
        except OSError as failure:  # the next start removes it; never mask the save's error
            log.warning("could not remove abandoned local %s: %s", step_folder(step), failure)

    def remove_uncommitted(self) -> None:
        """Delete local ``step-N/`` folders without a manifest (node leaders, at start)."""
        for step in uncommitted_steps(self.store):
            log.warning("removing abandoned partial checkpoint %s", self.store.describe(step_folder(step)))
            self.store.delete_prefix(step_folder(step))


def read_with_fallback(
    manifest: Manifest, names: list[str], local: Store | None, remote: Store
) -> tuple[dict[str, bytes], dict[str, str]]:
    """Read and verify ``names`` of the checkpoint ``manifest`` describes: each from
    ``local`` if its copy verifies there, else from ``remote``.

    Returns:
        (contents, where each file came from: ``local`` or ``remote``).

    Raises:
        CorruptCheckpointError: a file verifies in neither place.
    """
    step = manifest.step
    folder = step_folder(step)
    contents: dict[str, bytes] = {}
    sources: dict[str, str] = {}
    for name in names:
        key = f"{folder}/{name}"
        expected = manifest.files.get(name)
        if expected is None:
            raise CorruptCheckpointError(f"{remote.describe(key)} is not listed in the manifest")
        problems = []
        for label, store in (("local", local), ("remote", remote)):
            if store is None:
                continue
            try:
                contents[name], sources[name] = verified_file(store, key, expected), label
                break
            except CorruptCheckpointError as problem:
                problems.append(str(problem))
        else:
            raise CorruptCheckpointError("; ".join(problems))
        if problems and sources[name] == "remote" and not problems[0].endswith("but missing"):
            log.warning("used the root's copy: %s", problems[0])
    return contents, sources


def manifest_with_fallback(step: int, local: Store | None, remote: Store) -> Manifest:
    """The local manifest if it reads and lists a complete checkpoint, else the root's
    (a local manifest that is there but does not read is named in a warning)."""
    key = f"{step_folder(step)}/{MANIFEST}"
    if local is not None and local.exists(key):
        try:
            return read_manifest(local, step)
        except (CorruptCheckpointError, StorageError, OSError) as error:
            log.warning("used the root's manifest: %s", error)
    return read_manifest(remote, step)


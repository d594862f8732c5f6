"""Where a framework's checkpoints live, how one is committed, and which one a restart takes.

- The Trainer writes into its ``output_dir`` (:func:`checkpoints_beside`); Lightning's
  checkpoints are written by skylift's callback into the checkpoint root when that is
  a folder, else into a local folder in front of the object store
  (:func:`checkpoints_under`).
- The mirror is the checkpoint root (``SKYLIFT_CHECKPOINT_ROOT`` or ``checkpoint.root``)
  wherever it is not that local folder: ``s3://``, ``oss://``, ``cos://``, or another
  folder (a platform's synced checkpoint folder).
- :func:`commit` seals a folder and mirrors it; :func:`newest_complete` picks the
  checkpoint a restart resumes from, restoring it from the mirror when that holds a
  newer complete one.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from skylift.checkpoint.manifest import CorruptCheckpointError
from skylift.config.schema import RunConfig
from skylift.errors import SkyliftConfigError
from skylift.integrations.checkpoints import FolderCheckpoints, seal, verify_folder
from skylift.integrations.run import ScriptRun
from skylift.storage import StorageError, Store, open_store
from skylift.storage.local import LocalStore

__all__ = ["checkpoints_beside", "checkpoints_under", "commit", "lease_root", "newest_complete"]

log = logging.getLogger("skylift")

_POLL_S = 0.5


def _is_url(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


def checkpoints_beside(directory: str | os.PathLike[str], prefix: str, config: RunConfig) -> FolderCheckpoints:
    """A framework's own checkpoint folder, mirrored to the checkpoint root if that is elsewhere."""
    root = config.checkpoint.root
    mirror = None
    if root and (_is_url(root) or Path(root.removeprefix("file://")).resolve() != Path(directory).resolve()):
        mirror = open_store(root, endpoint_url=config.checkpoint.endpoint_url)
    return FolderCheckpoints(directory, prefix, mirror=mirror, keep=config.checkpoint.keep)


def checkpoints_under(prefix: str, config: RunConfig) -> FolderCheckpoints:
    """Checkpoints skylift itself asks the framework to write (Lightning's): in the checkpoint
    root when it is a folder; else in ``checkpoint.local_root`` (default ``RUN_DIR/checkpoints``)
    in front of the object store."""
    root = config.checkpoint.root
    if root and not _is_url(root):
        return FolderCheckpoints(root.removeprefix("file://"), prefix, keep=config.checkpoint.keep)
    local = config.checkpoint.local_root or str(config.run_dir / "checkpoints")
    return checkpoints_beside(local, prefix, config)


def lease_root(checkpoints: FolderCheckpoints, config: RunConfig, *, default: Path | None = None) -> Store:
    """Where a framework job's run lease lives: the checkpoint root when one is set (the mirror,
    or the folder itself: where ``skylift launch --checkpoint-root`` holds its lease), else
    ``default`` (a folder skylift chose: Lightning's run folder, which holds its
    ``checkpoints/``), else the folder the framework writes its checkpoints into."""
    if checkpoints.mirror is not None:
        return checkpoints.mirror
    folder = checkpoints.directory if config.checkpoint.root or default is None else default
    folder.mkdir(parents=True, exist_ok=True)
    return LocalStore(folder)


def commit(run: ScriptRun, checkpoints: FolderCheckpoints, step: int, *, started_at_s: float) -> bool:
    """Rank 0, once every rank wrote its files: seal ``step``'s folder, mirror it, write the
    ``checkpoint`` (and ``preemption``) records. Returns whether the local commit succeeded.

    A failure is recorded, not raised: the previous complete checkpoint stands and
    training goes on (the framework's loop is not skylift's to end)."""
    error = upload_error = None
    uploaded_at_s = None
    try:
        manifest = seal(checkpoints.folder(step), step, run.context.world_size)
    except (CorruptCheckpointError, OSError) as failure:
        error = str(failure)
        log.warning("checkpoint %s is not complete: %s", checkpoints.folder(step), failure)
    if error is None and checkpoints.mirror is not None:
        try:
            checkpoints.upload(step, manifest)
            uploaded_at_s = time.perf_counter()
        except (CorruptCheckpointError, StorageError, OSError) as failure:
            upload_error = str(failure)
            log.warning("checkpoint %s did not reach %s: %s", step, checkpoints.mirror.describe(), failure)
    run.saved(step, started_at_s=started_at_s, error=error, uploaded_at_s=uploaded_at_s, upload_error=upload_error)
    return error is None


def newest_complete(checkpoints: FolderCheckpoints, *, wait_s: float = 1800.0) -> Path | None:
    """The newest complete checkpoint folder on local disk, after restoring a newer one from the mirror.

    The first process of each node (``LOCAL_RANK`` 0) restores; the node's other
    processes wait up to ``wait_s`` for that copy to verify, so a node downloads once.

    Raises:
        SkyliftConfigError: the node's first process did not restore the checkpoint in ``wait_s``.
        CorruptCheckpointError: a mirrored file does not match its manifest.
    """
    local = checkpoints.newest_local()
    mirrored = checkpoints.newest_mirrored()
    if mirrored is None or (local is not None and local >= mirrored.step):
        folder = checkpoints.folder(local) if local is not None else None
    elif int(os.environ.get("LOCAL_RANK", "0")) == 0:
        assert checkpoints.mirror is not None
        _say(f"restoring checkpoint step {mirrored.step} from {checkpoints.mirror.describe()}")
        folder = checkpoints.restore(mirrored)
    else:
        folder = _wait_for_restore(checkpoints, mirrored.step, wait_s)
    if folder is not None:
        _say(f"resuming from {folder} (the newest complete checkpoint)")
    return folder


def _say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"skylift: {message}", file=sys.stderr)


def _wait_for_restore(checkpoints: FolderCheckpoints, step: int, wait_s: float) -> Path:
    folder = checkpoints.folder(step)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            verify_folder(folder, step)
            return folder
        except (CorruptCheckpointError, OSError):
            time.sleep(_POLL_S)
    raise SkyliftConfigError(
        f"{folder} was not restored from {checkpoints.mirror.describe() if checkpoints.mirror else 'the mirror'} "
        f"within {wait_s:.0f} s by this node's first process (LOCAL_RANK 0)",
        hint="Check that process's log; call resume_checkpoint() in every process, or raise wait_s.",
    )

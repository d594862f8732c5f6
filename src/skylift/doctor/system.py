"""The disks a run writes to and the small system files the gatherers read.

Below :mod:`~skylift.doctor.gather`, :mod:`~skylift.doctor.job` and
:mod:`~skylift.doctor.network`, which all read them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from skylift.machine.facts import DiskFacts, DiskPurpose

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = ["gather_disks", "read_text"]

_DEFAULT_CACHE = "~/.cache/skylift"


def gather_disks(config: RunConfig | None) -> list[DiskFacts]:
    """Free space where the run, the cache and local checkpoints would be written."""
    run_dir = Path(config.run_dir) if config is not None else Path("runs")
    folders: list[tuple[DiskPurpose, Path]] = [("run_dir", run_dir)]
    cache = config.data.cache_dir if config is not None else _DEFAULT_CACHE
    folders.append(("cache", Path(os.path.expanduser(cache))))
    local = _local_checkpoint_folder(config, run_dir) if config is not None else None
    if local is not None:
        folders.append(("checkpoint_local", local))
    if config is not None and config.checkpoint.enabled and config.checkpoint.memory.enabled:
        folders.append(("checkpoint_memory", Path(config.checkpoint.memory.root)))  # a tmpfs: host memory
    return [_disk(purpose, folder) for purpose, folder in folders]


def _local_checkpoint_folder(config: RunConfig, run_dir: Path) -> Path | None:
    checkpoint = config.checkpoint
    if checkpoint.memory.enabled and "://" in (checkpoint.root or ""):
        return None  # the memory tier holds the local copies (see "checkpoint_memory")
    if checkpoint.local_root:
        return Path(os.path.expanduser(checkpoint.local_root))
    root = checkpoint.root or ""
    if not root:
        return run_dir / "checkpoints"
    if root.startswith("file://"):
        return Path(root.removeprefix("file://"))
    return None if "://" in root else Path(os.path.expanduser(root))


def _disk(purpose: DiskPurpose, folder: Path) -> DiskFacts:
    existing = folder.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        usage, device = shutil.disk_usage(existing), existing.stat().st_dev
    except OSError:
        return DiskFacts(purpose=purpose, path=str(folder), exists=False)
    return DiskFacts(
        purpose=purpose,
        path=str(folder),
        exists=folder.exists(),
        free_bytes=usage.free,
        total_bytes=usage.total,
        device=device,
    )


def read_text(path: Path) -> str | None:
    """The stripped text of a small system file; None when it cannot be read."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return None

"""A framework's checkpoint folders under skylift's commit rule: seal, verify, mirror, restore.

Real files on disk, a real ``LocalStore`` mirror and a moto S3 server on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest

from skylift.checkpoint.manifest import MANIFEST, CorruptCheckpointError
from skylift.config.load import load_config
from skylift.integrations.checkpoints import FolderCheckpoints, seal, verify_folder
from skylift.integrations.commit import checkpoints_beside, checkpoints_under, newest_complete
from skylift.integrations.run import resolve_config
from skylift.storage import open_store
from skylift.storage.local import LocalStore

PREFIX = "checkpoint-"


def _write_checkpoint(directory: Path, step: int, *, sealed: bool = True) -> Path:
    """A Trainer-like folder: weights, optimizer state, a nested file; sealed unless told."""
    folder = directory / f"{PREFIX}{step}"
    (folder / "nested").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(3000) + bytes([step]))
    (folder / "optimizer.pt").write_bytes(os.urandom(5000))
    (folder / "nested" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if sealed:
        seal(folder, step, world_size=2)
    return folder


def test_seal_lists_every_file_with_its_size_and_sha256(tmp_path):
    folder = _write_checkpoint(tmp_path, 8, sealed=False)
    manifest = seal(folder, 8, world_size=2)
    names = {"model.safetensors", "optimizer.pt", "nested/trainer_state.json"}
    assert set(manifest.files) == names
    for name in names:
        data = (folder / name).read_bytes()
        assert manifest.files[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    written = json.loads((folder / MANIFEST).read_text())
    assert (written["step"], written["world_size"]) == (8, 2)
    assert verify_folder(folder, 8).files == manifest.files


def test_torn_and_corrupt_folders_are_skipped_with_a_warning_naming_them(tmp_path, caplog):
    _write_checkpoint(tmp_path, 8)
    unsealed = _write_checkpoint(tmp_path, 16, sealed=False)  # killed before the manifest
    truncated = _write_checkpoint(tmp_path, 24)
    with open(truncated / "optimizer.pt", "r+b") as handle:
        handle.truncate(100)  # a file cut short after the seal (disk trouble)
    flipped = _write_checkpoint(tmp_path, 32)
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[10] ^= 0xFF
    (flipped / "model.safetensors").write_bytes(bytes(data))
    borrowed = _write_checkpoint(tmp_path, 40, sealed=False)
    (borrowed / MANIFEST).write_bytes((tmp_path / f"{PREFIX}8" / MANIFEST).read_bytes())  # another step's manifest

    checkpoints = FolderCheckpoints(tmp_path, PREFIX)
    with caplog.at_level(logging.WARNING, logger="skylift"):
        assert checkpoints.newest_local() == 8
    warned = caplog.text
    for folder, why in ((unsealed, "has no manifest.json"), (truncated, "does not match the manifest"),
                        (flipped, "does not match the manifest"), (borrowed, "is for step 8")):
        assert f"skipping checkpoint {folder}" in warned and why in warned, warned


def test_a_folder_that_is_not_there_or_empty_cannot_be_sealed(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="does not exist"):
        seal(tmp_path / f"{PREFIX}3", 3, world_size=1)
    (tmp_path / f"{PREFIX}4").mkdir()
    with pytest.raises(CorruptCheckpointError, match="holds no file"):
        seal(tmp_path / f"{PREFIX}4", 4, world_size=1)


class _RecordingStore(LocalStore):
    """A real local store that remembers the order of its writes."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.writes: list[str] = []

    def write_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self.writes.append(key)
        super().write_bytes(key, data, if_absent=if_absent)

    def write_chunks(self, key: str, make_chunks) -> None:
        self.writes.append(key)
        super().write_chunks(key, make_chunks)


def test_the_mirror_gets_files_first_the_manifest_last_and_keeps_the_newest(tmp_path):
    mirror = _RecordingStore(tmp_path / "mirror")
    checkpoints = FolderCheckpoints(tmp_path / "local", PREFIX, mirror=mirror, keep=2)
    for step in (8, 16, 24):
        checkpoints.upload(step, verify_folder(_write_checkpoint(tmp_path / "local", step), step))
    first = mirror.writes[:4]
    assert first[-1] == f"{PREFIX}8/{MANIFEST}" and len(set(first)) == 4, mirror.writes
    assert {key.partition("/")[0] for key in mirror.list()} == {f"{PREFIX}16", f"{PREFIX}24"}
    newest = checkpoints.newest_mirrored()
    assert newest is not None and newest.step == 24


def test_a_restart_on_a_fresh_disk_restores_the_newest_mirrored_checkpoint(tmp_path):
    mirror = LocalStore(tmp_path / "mirror")
    original = FolderCheckpoints(tmp_path / "machine-1", PREFIX, mirror=mirror)
    for step in (8, 16):
        original.upload(step, verify_folder(_write_checkpoint(tmp_path / "machine-1", step), step))
    fresh = FolderCheckpoints(tmp_path / "machine-2", PREFIX, mirror=mirror)
    folder = newest_complete(fresh)
    assert folder == tmp_path / "machine-2" / f"{PREFIX}16"
    verify_folder(folder, 16)
    for name in ("model.safetensors", "optimizer.pt", "nested/trainer_state.json"):
        assert (folder / name).read_bytes() == (tmp_path / "machine-1" / f"{PREFIX}16" / name).read_bytes()
    # A local checkpoint as new as the mirror's is used as it is.
    assert newest_complete(original) == tmp_path / "machine-1" / f"{PREFIX}16"


def test_upload_refuses_a_file_that_changed_after_the_seal(tmp_path):
    checkpoints = FolderCheckpoints(tmp_path / "local", PREFIX, mirror=LocalStore(tmp_path / "mirror"))
    folder = _write_checkpoint(tmp_path / "local", 8)
    manifest = verify_folder(folder, 8)
    (folder / "optimizer.pt").write_bytes(b"rewritten")
    with pytest.raises(CorruptCheckpointError, match="changed after it was sealed"):
        checkpoints.upload(8, manifest)
    assert checkpoints.newest_mirrored() is None  # no manifest went up


def test_prune_local_keeps_the_newest_complete_and_drops_older_torn_ones(tmp_path):
    checkpoints = FolderCheckpoints(tmp_path, "step-", keep=2)
    for step in (2, 4, 6, 8):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        (folder / "lightning.ckpt").write_bytes(os.urandom(100))
        if step != 4:
            seal(folder, step, world_size=1)
    checkpoints.prune_local(8)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-6", "step-8"]


def test_on_s3_a_corrupt_object_fails_the_restore_naming_it_and_leaves_no_file(tmp_path, s3_bucket, moto_server):
    store = open_store(f"s3://{s3_bucket}/job", endpoint_url=moto_server.endpoint_url)
    checkpoints = FolderCheckpoints(tmp_path / "local", PREFIX, mirror=store, keep=2)
    for step in (8, 16, 24):
        checkpoints.upload(step, verify_folder(_write_checkpoint(tmp_path / "local", step), step))
    assert sorted({key.partition("/")[0] for key in store.list()}) == [f"{PREFIX}16", f"{PREFIX}24"]

    fresh = FolderCheckpoints(tmp_path / "fresh", PREFIX, mirror=store)
    restored = newest_complete(fresh)
    assert restored == tmp_path / "fresh" / f"{PREFIX}24"
    verify_folder(restored, 24)

    size = len((tmp_path / "local" / f"{PREFIX}24" / "optimizer.pt").read_bytes())
    store.write_bytes(f"{PREFIX}24/optimizer.pt", b"\0" * size)  # same size: only the hash tells
    other = FolderCheckpoints(tmp_path / "other", PREFIX, mirror=store)
    with pytest.raises(CorruptCheckpointError, match=rf"{PREFIX}24/optimizer.pt does not match its manifest"):
        newest_complete(other)
    assert not (tmp_path / "other" / f"{PREFIX}24" / "optimizer.pt").exists()
    assert not (tmp_path / "other" / f"{PREFIX}24" / MANIFEST).exists()


def test_the_environment_wins_over_the_config_and_the_framework_default(tmp_path):
    config = load_config(None, ["checkpoint.root=/config/root"])
    environ = {"SKYLIFT_RUN_DIR": str(tmp_path / "from-env"), "SKYLIFT_CHECKPOINT_ROOT": "s3://bucket/job"}
    told = resolve_config(config, default_run_dir="output", environ=environ)
    assert (told.run_dir, told.checkpoint.root) == (tmp_path / "from-env", "s3://bucket/job")
    assert resolve_config(None, default_run_dir="output", environ={}).run_dir == Path("output")
    named = load_config(None, ["run_dir=runs/mine"])
    assert resolve_config(named, default_run_dir="output", environ={}).run_dir == Path("runs/mine")


def test_where_checkpoints_live_and_where_they_are_mirrored(tmp_path):
    same = load_config(None, [f"checkpoint.root={tmp_path / 'out'}"])
    assert checkpoints_beside(tmp_path / "out", PREFIX, same).mirror is None
    elsewhere = checkpoints_beside(tmp_path / "out", PREFIX, load_config(None, [f"checkpoint.root={tmp_path / 'sync'}"]))
    assert elsewhere.mirror is not None and elsewhere.mirror.url == str(tmp_path / "sync")

    folder_root = checkpoints_under("step-", load_config(None, [f"checkpoint.root={tmp_path / 'ckpt'}"]))
    assert (folder_root.directory, folder_root.mirror) == (tmp_path / "ckpt", None)
    in_front = checkpoints_under("step-", load_config(None, [f"run_dir={tmp_path / 'run'}", "checkpoint.root=s3://b/j",
                                                             "checkpoint.keep=4"]))
    assert in_front.directory == tmp_path / "run" / "checkpoints"
    assert in_front.mirror is not None and in_front.mirror.url == "s3://b/j" and in_front.keep == 4

"""A checkpoint's manifest (or its DCP metadata) cannot make skylift read or write outside
the checkpoint's folder (issue 41).

Every name a manifest lists becomes a path or key under ``step-N/``: a resume reads it,
a framework checkpoint's restore from its mirror writes it to local disk. A name that is
not a relative path inside the folder (``..``, absolute, empty or ``.`` segments,
backslashes, control characters) makes the manifest unreadable: readers skip that
checkpoint with a warning naming it and the name, as they skip a corrupt one, and
nothing is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os

import pytest

from skylift.checkpoint.manifest import MANIFEST, Manifest, file_entry, find_latest_valid
from skylift.checkpoint.sharded import METADATA_FORMAT, decode_metadata
from skylift.checkpoint.state import required_files
from skylift.checkpoint.tiers import LocalTier, manifest_with_fallback
from skylift.integrations.checkpoints import FolderCheckpoints
from skylift.storage import open_store
from skylift.storage.local import LocalStore
from skylift.storage.names import UnsafeNameError

EVIL = b"import os; os.system('echo owned')\n"
SECRET = b"a file outside the checkpoint root\n"


def _manifest(step: int, files: dict[str, bytes], extra: dict[str, bytes]) -> bytes:
    """A manifest listing ``files`` and ``extra`` with their true sizes and sha256."""
    entries = {name: file_entry(data) for name, data in {**files, **extra}.items()}
    return Manifest.create(step, 1, entries).encode()


def _checkpoint(store, step: int, extra: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """A replicated one-rank checkpoint (its files' bytes arbitrary: only hashes are read here)."""
    files = {name: os.urandom(64) for name in sorted(required_files(1))}
    for name, data in files.items():
        store.write_bytes(f"step-{step}/{name}", data)
    store.write_bytes(f"step-{step}/{MANIFEST}", _manifest(step, files, extra or {}))
    return files


def test_a_resume_skips_a_checkpoint_whose_manifest_names_a_file_outside_it(tmp_path, caplog):
    root = LocalStore(tmp_path / "checkpoints" / "root")
    (tmp_path / "checkpoints" / "outside").mkdir(parents=True)
    (tmp_path / "checkpoints" / "outside" / "secret.bin").write_bytes(SECRET)
    _checkpoint(root, 3)
    bad = "../../outside/secret.bin"  # from step-5/: tmp/checkpoints/outside/secret.bin
    _checkpoint(root, 5, {bad: SECRET})
    with caplog.at_level(logging.WARNING, logger="skylift"):
        found = find_latest_valid(root)
    assert found is not None
    manifest, contents = found
    assert SECRET not in contents.values(), "a file outside the checkpoint root was read as part of it"
    assert manifest.step == 3, "the newer checkpoint with the bad name was not skipped"
    assert f"{root.describe('step-5/manifest.json')}: file name {bad!r}" in caplog.text, caplog.text


def _evil_mirror_step(mirror, bad: str) -> None:
    """``checkpoint-5`` in a mirror: one real file, and the evil file under ``bad``, both listed."""
    model = os.urandom(64)
    mirror.write_bytes("checkpoint-5/model.safetensors", model)
    mirror.write_bytes(f"checkpoint-5/{MANIFEST}", _manifest(5, {"model.safetensors": model}, {bad: EVIL}))


def _restore_newest(checkpoints: FolderCheckpoints) -> None:
    newest = checkpoints.newest_mirrored()
    if newest is not None:
        checkpoints.restore(newest)


def test_a_mirror_on_local_disk_cannot_make_a_restore_write_outside_the_folder(tmp_path, caplog):
    mirror_root = tmp_path / "m" / "i" / "r" / "ror"
    mirror = LocalStore(mirror_root)
    bad = "../../planted/evil.pth"  # the mirror's key reaches tmp/m/i/r/planted, the restore tmp/planted
    (tmp_path / "m" / "i" / "r" / "planted").mkdir(parents=True)
    (tmp_path / "m" / "i" / "r" / "planted" / "evil.pth").write_bytes(EVIL)
    _evil_mirror_step(mirror, bad)
    with caplog.at_level(logging.WARNING, logger="skylift"):
        with contextlib.suppress(Exception):  # whatever happened, the file check comes first
            _restore_newest(FolderCheckpoints(tmp_path / "local", "checkpoint-", mirror=mirror))
    assert not (tmp_path / "planted" / "evil.pth").exists(), "the restore wrote outside its folder"
    assert f"file name {bad!r}" in caplog.text and "checkpoint-5" in caplog.text, caplog.text


def test_a_mirror_on_s3_cannot_make_a_restore_write_outside_the_folder(tmp_path, caplog, moto_server, s3_bucket):
    mirror = open_store(f"s3://{s3_bucket}/mirror", endpoint_url=moto_server.endpoint_url)
    bad = "../../planted/evil.pth"
    mirror.write_bytes(f"checkpoint-5/{bad}", EVIL)  # S3 keys are literal: the object is there
    _evil_mirror_step(mirror, bad)
    with caplog.at_level(logging.WARNING, logger="skylift"):
        with contextlib.suppress(Exception):
            _restore_newest(FolderCheckpoints(tmp_path / "local", "checkpoint-", mirror=mirror))
    assert not (tmp_path / "planted" / "evil.pth").exists(), "the restore wrote outside its folder"
    assert f"s3://{s3_bucket}/mirror/checkpoint-5/manifest.json: file name {bad!r}" in caplog.text, caplog.text


def test_the_local_tier_refuses_a_manifest_naming_a_file_outside_it_and_uses_the_roots(tmp_path, caplog):
    remote = LocalStore(tmp_path / "remote")
    files = _checkpoint(remote, 5)
    tier = LocalTier(str(tmp_path / "node-disk"), remote, node_leader=True)
    bad = "../../../outside/secret.bin"
    for name, data in files.items():
        tier.store.write_bytes(f"step-5/{name}", data)
    tier.store.write_bytes(f"step-5/{MANIFEST}", _manifest(5, files, {bad: SECRET}))
    with caplog.at_level(logging.WARNING, logger="skylift"):
        manifest = manifest_with_fallback(5, tier.store, remote)
    assert bad not in manifest.files, "the local manifest naming a file outside the tier was used"
    assert "used the root's manifest" in caplog.text and repr(bad) in caplog.text, caplog.text


BAD_RELATIVE_NAMES = ["../x", "a/../../x", "/etc/passwd", "..", ".", "", "a//b", "a/./b", "a/", "a\\..\\b", "a\x00b",
                      "a\nb"]


@pytest.mark.parametrize("name", BAD_RELATIVE_NAMES, ids=repr)
def test_a_manifest_listing_a_name_outside_its_folder_does_not_read(name):
    document = json.loads(_manifest(5, {"model.safetensors": b"w"}, {}))
    document["files"][name] = {"size": 1, "sha256": hashlib.sha256(b"w").hexdigest()}
    with pytest.raises(UnsafeNameError, match="s3://bucket/run/step-5/manifest.json: file name") as refused:
        Manifest.decode(json.dumps(document).encode(), "s3://bucket/run/step-5/manifest.json")
    assert "\n" not in str(refused.value), "one line"


def test_nested_relative_names_still_read():
    """Framework checkpoints (Hugging Face, Lightning) hold subfolders: ``a/b`` is a relative path inside."""
    manifest = Manifest.decode(_manifest(5, {"sub/dir/file.bin": b"x", "model.safetensors": b"y"}, {}), "here")
    assert sorted(manifest.files) == ["model.safetensors", "sub/dir/file.bin"]


@pytest.mark.parametrize("name", ["../model-rank0.safetensors", "/tmp/x.safetensors", "sub/model.safetensors", ""],
                         ids=repr)
def test_dcp_metadata_naming_a_chunk_file_outside_the_folder_is_refused(name):
    document = {"format": METADATA_FORMAT, "tensors": {},
                "storage": [{"fqn": "model/weight", "offsets": [0], "file": name, "key": "model/weight@0"}]}
    with pytest.raises(UnsafeNameError, match=r"step-5/dcp-metadata.json: chunk file name"):
        decode_metadata(json.dumps(document).encode(), "/ckpt/step-5/dcp-metadata.json")


@pytest.mark.parametrize("key", ["../evil.pth", "step-5/../../evil.pth", "ABSOLUTE", "a/../b"], ids=repr)
def test_a_local_store_refuses_a_key_outside_its_folder(tmp_path, key):
    """Defence in depth, under every reader's own check."""
    store = LocalStore(tmp_path / "store" / "root")
    key = str(tmp_path / "absolute" / "evil.pth") if key == "ABSOLUTE" else key
    with pytest.raises(UnsafeNameError, match="refused"):
        store.write_bytes(key, EVIL)
    with pytest.raises(UnsafeNameError):
        store.read_bytes(key)
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


def test_a_local_store_still_takes_nested_keys(tmp_path):
    store = LocalStore(tmp_path / "root")
    store.write_bytes("step-5/sub/file.bin", b"x")
    assert store.read_bytes("step-5/sub/file.bin") == b"x" and store.list() == ["step-5/sub/file.bin"]

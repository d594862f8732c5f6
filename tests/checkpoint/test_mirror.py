"""checkpoint/mirror.py: the one copy of step folders between this node's disk and a store,
used by the node-local tier (tiers.py) and by a framework's mirrored checkpoint folders
(integrations/checkpoints.py). Real folders; the S3 side is covered by their own tests."""

from __future__ import annotations

import pytest

from skylift.checkpoint.manifest import MANIFEST, CorruptCheckpointError, Manifest, file_entry
from skylift.checkpoint.mirror import PIECE_BYTES, FolderMirror
from skylift.checkpoint.tiers import LocalTier
from skylift.integrations.checkpoints import FolderCheckpoints, seal
from skylift.storage.local import LocalStore


def test_the_local_tier_and_a_framework_mirror_refuse_a_changed_file_with_one_message(tmp_path):
    """Both copy a file only if it still matches the entry taken when it was written; the
    root (or mirror) keeps no manifest for it."""
    tier = LocalTier(str(tmp_path / "disk"), LocalStore(tmp_path / "root"), node_leader=True)
    tier.store.write_bytes("step-3/model.safetensors", b"rewritten after the hash")
    with pytest.raises(CorruptCheckpointError, match=r"step-3/model.safetensors changed after it was sealed"):
        tier.upload(3, {"model.safetensors": file_entry(b"the weights as written")})

    framework = FolderCheckpoints(tmp_path / "out", "checkpoint-", mirror=LocalStore(tmp_path / "mirror"))
    (tmp_path / "out" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "out" / "checkpoint-3" / "model.pt").write_bytes(b"the weights as written")
    manifest = seal(tmp_path / "out" / "checkpoint-3", 3, 1)
    (tmp_path / "out" / "checkpoint-3" / "model.pt").write_bytes(b"rewritten after the seal")
    with pytest.raises(CorruptCheckpointError, match=r"checkpoint-3/model.pt changed after it was sealed"):
        framework.upload(3, manifest)
    assert not (tmp_path / "mirror" / "checkpoint-3" / MANIFEST).exists()


def test_a_file_larger_than_one_piece_goes_up_and_comes_back_whole(tmp_path):
    """Files are streamed in pieces both ways: one of 2.5 pieces round-trips bit for bit."""
    payload = bytes(range(256)) * (PIECE_BYTES * 5 // 2 // 256)
    source = FolderMirror(tmp_path / "machine-1", LocalStore(tmp_path / "store"), "step-")
    source.local.write_bytes("step-4/model.safetensors", payload)
    manifest = Manifest.create(4, 1, {"model.safetensors": file_entry(payload)})
    source.upload(4, manifest, keep=2)
    fresh = FolderMirror(tmp_path / "machine-2", LocalStore(tmp_path / "store"), "step-")
    assert fresh.remote_steps() == {4}
    folder = fresh.restore(4, fresh.remote_manifest(4))
    assert (folder / "model.safetensors").read_bytes() == payload
    assert Manifest.decode((folder / MANIFEST).read_bytes(), "restored").files == manifest.files

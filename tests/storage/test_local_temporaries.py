"""A local store's folders that a killed writer left temporaries in are removed with their
keys (issue 41, item 12): ``list`` hides temporaries, so nothing else would ever see them."""

from __future__ import annotations

from skylift.storage.local import LocalStore


def test_delete_prefix_removes_a_folder_holding_temporaries(tmp_path):
    store = LocalStore(tmp_path)
    store.write_bytes("step-3/model.bin", b"weights")
    store.write_bytes("step-4/model.bin", b"kept")
    # What a writer killed mid-write leaves: the hidden temporary its rename never published.
    (tmp_path / "step-3" / ".skylift-tmp-optimizer.bin.0123abcd").write_bytes(b"half")
    (tmp_path / "step-3" / "shards").mkdir()
    (tmp_path / "step-3" / "shards" / ".skylift-tmp-0.distcp.4567").write_bytes(b"half")

    store.delete_prefix("step-3")

    assert not (tmp_path / "step-3").exists()
    assert store.list() == ["step-4/model.bin"]

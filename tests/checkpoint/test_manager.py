"""The commit protocol on every store: manifest last, retention after commit, verified reads."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from skylift.checkpoint.manager import CheckpointManager
from skylift.checkpoint.manifest import (
    LATEST,
    CorruptCheckpointError,
    committed_steps,
    find_latest_valid,
    read_manifest,
    read_verified,
)
from skylift.checkpoint.state import capture
from skylift.storage import open_store


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def _capture(model, step):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.weight.add_(step)  # each step's weights differ
    return lambda: capture(step=step, rank=0, model=model, optimizer=optimizer, scheduler=None, scaler=None,
                           counters={"step": step, "epoch": 0, "samples_seen": 0})


@pytest.mark.parametrize("async_save", [False, True])
def test_save_commits_with_manifest_and_latest(store, model, async_save):
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=async_save)
    result = manager.save(_capture(model, 5), 5)
    manager.wait()
    assert result.committed and result.error is None
    manifest = read_manifest(store, 5)
    assert set(manifest.files) == {"model.safetensors", "optimizer.safetensors", "optimizer.json",
                                   "trainer.json", "rng-rank0.safetensors", "rng-rank0.json"}
    assert read_verified(store, 5, manifest).keys() == manifest.files.keys()
    assert store.read_bytes(LATEST) == b"step-5\n"
    manager.close()


def test_retention_deletes_only_after_a_newer_commit(store, model):
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=False)
    for step in (1, 2, 3):
        manager.save(_capture(model, step), step)
    assert committed_steps(store) == [2, 3]
    assert not store.list("step-1")


def test_a_failed_save_keeps_both_earlier_commits(store, model, monkeypatch):
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=False)
    for step in (1, 2):
        manager.save(_capture(model, step), step)
    monkeypatch.setenv("SKYLIFT_FAULT_INJECTION", "during_payload:step=3:action=enospc")
    result = manager.save(_capture(model, 3), 3)
    assert not result.committed and "No space left" in result.error
    assert committed_steps(store) == [1, 2]
    assert not store.list("step-3"), "the abandoned folder is removed"
    assert store.read_bytes(LATEST) == b"step-2\n"


def test_retention_removes_an_abandoned_timeline_at_the_first_commit_of_the_new_one(store, model):
    first = CheckpointManager(store, rank=0, world_size=1, keep=3, async_save=False)
    for step in (10, 20, 25, 30):
        first.save(_capture(model, step), step)
    assert committed_steps(store) == [20, 25, 30]
    rolled_back = CheckpointManager(store, rank=0, world_size=1, keep=3, async_save=False)
    rolled_back.timeline = (("0", None), ("a1b2c3d4", 20))  # resumed from step 20
    rolled_back.save(_capture(model, 21), 21)
    assert committed_steps(store) == [20, 21]
    assert store.read_bytes(LATEST) == b"step-21\n"
    assert read_manifest(store, 21).timeline == (("0", None), ("a1b2c3d4", 20))


def test_retention_keeps_a_fresh_start_over_newer_numbered_checkpoints(store, model):
    """Steps 20/25/30 were all corrupt; the run started over: its 5, 10, 15 are the newest."""
    first = CheckpointManager(store, rank=0, world_size=1, keep=3, async_save=False)
    for step in (20, 25, 30):
        first.save(_capture(model, step), step)
    fresh = CheckpointManager(store, rank=0, world_size=1, keep=3, async_save=False)
    fresh.timeline = (("e5f6a7b8", None),)
    fresh.save(_capture(model, 5), 5)
    assert committed_steps(store) == [5]
    for step in (10, 15, 20):
        fresh.save(_capture(model, step), step)
    assert committed_steps(store) == [10, 15, 20]
    assert store.read_bytes(LATEST) == b"step-20\n"


def test_keep_below_two_is_refused(store):
    with pytest.raises(ValueError, match="checkpoint.keep must be >= 2"):
        CheckpointManager(store, rank=0, world_size=1, keep=1, async_save=False)


def test_uncommitted_folders_are_invisible_and_cleaned(store, model):
    manager = CheckpointManager(store, rank=0, world_size=1, keep=3, async_save=False)
    manager.save(_capture(model, 1), 1)
    store.write_bytes("step-9/model.safetensors", b"half-written junk")
    assert committed_steps(store) == [1]
    found = find_latest_valid(store)
    assert found is not None and found[0].step == 1
    assert manager.remove_uncommitted() == [9]
    assert not store.list("step-9")


def test_a_folder_holding_only_temporaries_is_cleaned(tmp_path, model):
    """A writer killed during a step folder's first file leaves only its hidden temporary,
    which ``list`` never shows: the start-up cleanup must still remove the folder."""
    store = open_store(str(tmp_path / "root"))
    manager = CheckpointManager(store, rank=0, world_size=1, keep=3, async_save=False)
    manager.save(_capture(model, 1), 1)
    (tmp_path / "root" / "step-9").mkdir()
    (tmp_path / "root" / "step-9" / ".skylift-tmp-model.safetensors.0123abcd").write_bytes(b"half")
    (tmp_path / "root" / "step-10" / "shards").mkdir(parents=True)
    (tmp_path / "root" / "step-10" / "shards" / ".skylift-tmp-0.distcp.4567").write_bytes(b"half")
    assert manager.remove_uncommitted() == [9, 10]
    assert sorted(path.name for path in (tmp_path / "root").iterdir()) == ["LATEST", "step-1"]


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_file", "manifest_garbage", "manifest_missing_entry"])
def test_corrupt_newest_is_skipped_with_a_warning_naming_it(store, model, damage, caplog):
    manager = CheckpointManager(store, rank=0, world_size=1, keep=3, async_save=False)
    for step in (1, 2):
        manager.save(_capture(model, step), step)
    key = "step-2/model.safetensors"
    if damage == "flip_byte":
        data = bytearray(store.read_bytes(key))
        data[len(data) // 2] ^= 0xFF
        store.write_bytes(key, bytes(data))
    elif damage == "truncate":
        store.write_bytes(key, store.read_bytes(key)[:-10])
    elif damage == "delete_file":
        store.delete([key])
    elif damage == "manifest_garbage":
        store.write_bytes("step-2/manifest.json", b"{not json")
    else:
        manifest = json.loads(store.read_bytes("step-2/manifest.json"))
        del manifest["files"]["model.safetensors"]
        store.write_bytes("step-2/manifest.json", json.dumps(manifest).encode())
        store.write_bytes(key, b"replaced")
    with caplog.at_level(logging.WARNING, logger="skylift"):
        found = find_latest_valid(store)
    assert found is not None and found[0].step == 1
    assert "step-2" in caplog.text and "skipping checkpoint" in caplog.text


def test_verified_read_names_file_and_both_hashes(store, model):
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=False)
    manager.save(_capture(model, 1), 1)
    manifest = read_manifest(store, 1)
    store.write_bytes("step-1/trainer.json", b"{}")
    with pytest.raises(CorruptCheckpointError) as caught:
        read_verified(store, 1, manifest)
    message = str(caught.value)
    assert "step-1/trainer.json" in message
    assert manifest.files["trainer.json"]["sha256"] in message
    assert "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a" in message  # sha256 of b"{}"


def test_async_save_copies_in_the_background_but_before_the_next_optimizer_step(tmp_path):
    from safetensors.torch import load

    store = open_store(str(tmp_path / "root"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=True)

    def hold_the_update(*_):
        manager.wait_for_copies()

    optimizer.register_step_pre_hook(hold_the_update)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    manager.save(lambda: capture(step=1, rank=0, model=model, optimizer=optimizer, scheduler=None, scaler=None,
                                 counters={"step": 1, "epoch": 0, "samples_seen": 0}, defer=True), 1)
    for _ in range(3):  # training goes on at once; each step's update waits for the copy
        model(torch.randn(4, 64)).sum().backward()
        optimizer.step()
    manager.wait()
    saved = load(store.read_bytes("step-1/model.safetensors"))
    for name, tensor in expected.items():
        assert torch.equal(saved[name], tensor)


def test_cancel_stops_a_large_file_within_a_piece(store):
    """An emergency save cancels the older save in flight mid-file, not after the file."""
    import threading

    big = nn.Linear(4096, 2048, bias=False)  # one 32 MiB tensor: two 16 MiB pieces
    pieces, first_piece_written, release = [], threading.Event(), threading.Event()

    class Gate:
        """The store sees the chunks through this: it pauses after the first piece."""

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def write_chunks(self, key, make_chunks):
            def gated():
                if not key.endswith("model.safetensors"):
                    yield from make_chunks()
                    return
                for chunk in make_chunks():
                    pieces.append(len(memoryview(chunk).cast("B")))
                    if len(pieces) >= 2:
                        first_piece_written.set()
                        release.wait(10)
                    yield chunk
            self.inner.write_chunks(key, gated)

    manager = CheckpointManager(Gate(store), rank=0, world_size=1, keep=2, async_save=True)
    result = manager.save(_capture(big, 1), 1)
    assert first_piece_written.wait(30)
    manager.cancel_in_flight()
    release.set()
    manager.wait()
    manager.close()
    assert not result.committed and "cancelled" in result.error
    assert sum(pieces) < 32 * 2**20, "the rest of the tensor was handed to the store after the cancel"
    assert committed_steps(store) == []
    assert not any(key.startswith("step-1/") for key in store.list())


def test_a_run_start_cleans_a_folder_holding_only_temporaries(tmp_path):
    """The same through a run's start (the session's store is fenced by the lease)."""
    from tests.checkpoint.attempts import run_attempt

    root = tmp_path / "root"
    run_attempt(str(root), 4)
    (root / "step-6").mkdir()
    (root / "step-6" / ".skylift-tmp-model.safetensors.0123abcd").write_bytes(b"half")
    assert run_attempt(str(root)) == 4
    assert not (root / "step-6").exists()

"""A cached shard is hashed once when it arrives, and again only if the file changed since."""

from __future__ import annotations

import os
import time

from skylift.data import shard_cache
from skylift.data.shard_cache import ShardCache
from skylift.data.shards import ShardWriter
from skylift.storage.local import LocalStore


def _one_shard(tmp_path):
    store = LocalStore(str(tmp_path / "source"))
    writer = ShardWriter(store, shard_size_bytes=1 << 20)
    for index in range(10):
        writer.add({"bin": os.urandom(2000), "cls": str(index).encode()})
    return store, writer.close().shards[0]


def _count_hashes(monkeypatch) -> list[int]:
    calls = []
    original = shard_cache._matches

    def counting(data, shard):
        calls.append(1)
        return original(data, shard)

    monkeypatch.setattr(shard_cache, "_matches", counting)
    return calls


def test_an_unchanged_verified_copy_is_not_hashed_again(tmp_path, monkeypatch):
    store, shard = _one_shard(tmp_path)
    cache = ShardCache(store, tmp_path / "cache", limit_bytes=1 << 30)
    calls = _count_hashes(monkeypatch)
    expected = cache.read(shard)
    assert len(calls) == 1, "hashed once on download"
    for _ in range(3):  # the other workers of the rank, later epochs
        assert cache.read(shard) == expected
    assert len(calls) == 1
    assert cache.downloads == 1


def test_a_damaged_copy_is_hashed_and_fetched_again(tmp_path, monkeypatch, caplog):
    store, shard = _one_shard(tmp_path)
    cache = ShardCache(store, tmp_path / "cache", limit_bytes=1 << 30)
    expected = cache.read(shard)
    calls = _count_hashes(monkeypatch)
    damaged = bytearray(expected)
    damaged[700] ^= 0xFF
    cache.path(shard).write_bytes(bytes(damaged))
    assert cache.read(shard) == expected
    assert "failed its sha256 check" in caplog.text
    assert len(calls) == 2 and cache.downloads == 2  # the damaged copy, then the new download


def test_damage_that_restores_the_mtime_is_still_caught(tmp_path, caplog):
    """Size and mtime alike, content not: the ctime (which user space cannot set) differs."""
    store, shard = _one_shard(tmp_path)
    cache = ShardCache(store, tmp_path / "cache", limit_bytes=1 << 30)
    expected = cache.read(shard)
    path = cache.path(shard)
    before = path.stat()
    time.sleep(0.02)  # the kernel's ctime clock is coarse
    damaged = bytearray(expected)
    damaged[900] ^= 0xFF
    with open(path, "r+b") as handle:  # in place: same inode, same size
        handle.write(bytes(damaged))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns and path.stat().st_size == before.st_size
    assert cache.read(shard) == expected
    assert "failed its sha256 check" in caplog.text


def test_a_stamp_for_another_dataset_version_is_not_trusted(tmp_path, monkeypatch):
    store, shard = _one_shard(tmp_path)
    cache = ShardCache(store, tmp_path / "cache", limit_bytes=1 << 30)
    cache.read(shard)
    stamp = cache.path(shard).with_name(f".{shard.name}.verified")
    stamp.write_text(stamp.read_text().replace(shard.sha256, "0" * 64))
    calls = _count_hashes(monkeypatch)
    cache.read(shard)
    assert len(calls) == 1

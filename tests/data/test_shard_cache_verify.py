"""A cached shard is hashed again when read, except right after the lock holder verified it."""

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


def test_reader_that_waited_while_the_holder_verified_skips_the_hash(tmp_path, monkeypatch):
    store, shard = _one_shard(tmp_path)
    cache = ShardCache(store, tmp_path / "cache", limit_bytes=1 << 30)
    waited_since_ns = time.time_ns() - 1_000_000_000  # began waiting before the download
    cache.read(shard)
    calls = _count_hashes(monkeypatch)
    data = cache.path(shard).read_bytes()
    assert shard_cache._verified_while_waiting(cache.path(shard), data, shard, waited_since_ns)
    assert calls == []


def test_older_cached_copy_is_hashed_and_a_damaged_one_fetched_again(tmp_path, monkeypatch, caplog):
    store, shard = _one_shard(tmp_path)
    cache = ShardCache(store, tmp_path / "cache", limit_bytes=1 << 30)
    expected = cache.read(shard)
    time.sleep(0.05)  # the kernel's ctime clock is coarse
    calls = _count_hashes(monkeypatch)
    assert cache.read(shard) == expected
    assert len(calls) == 1
    damaged = bytearray(expected)
    damaged[700] ^= 0xFF
    cache.path(shard).write_bytes(bytes(damaged))
    time.sleep(0.05)
    assert cache.read(shard) == expected
    assert "failed its sha256 check" in caplog.text

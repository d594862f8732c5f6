"""The contract every storage backend passes (fsspec ``tests/abstract`` pattern).

Subclass and provide a ``store`` fixture returning an empty :class:`Store`.
"""

from __future__ import annotations

import threading

import pytest

from skylift.storage import StorageNotFoundError, StoragePreconditionFailed


class StoreConformance:
    def test_write_then_read(self, store):
        store.write_bytes("a/b/c.bin", b"payload")
        assert store.read_bytes("a/b/c.bin") == b"payload"
        assert store.size("a/b/c.bin") == 7
        assert store.exists("a/b/c.bin")

    def test_write_chunks_streams_the_same_object(self, store):
        chunks = [b"head", memoryview(b"-middle-"), bytes(range(256)) * 100]
        store.write_chunks("streamed", lambda: iter(chunks))
        assert store.read_bytes("streamed") == b"".join(bytes(chunk) for chunk in chunks)

    def test_overwrite_replaces_whole_object(self, store):
        store.write_bytes("x", b"first version, longer")
        store.write_bytes("x", b"second")
        assert store.read_bytes("x") == b"second"

    def test_missing_object(self, store):
        assert not store.exists("nope")
        with pytest.raises(StorageNotFoundError, match="nope"):
            store.read_bytes("nope")
        with pytest.raises(StorageNotFoundError):
            store.size("nope")

    def test_range_read(self, store):
        store.write_bytes("r", bytes(range(100)))
        assert store.read_range("r", 10, 20) == bytes(range(10, 20))
        assert store.read_range("r", 95, 100) == bytes(range(95, 100))
        assert store.read_range("r", 5, 5) == b""

    def test_list_is_recursive_sorted_and_prefix_scoped(self, store):
        for key in ("step-2/model", "step-1/model", "step-1/optim", "LATEST"):
            store.write_bytes(key, b"1")
        assert store.list() == ["LATEST", "step-1/model", "step-1/optim", "step-2/model"]
        assert store.list("step-1") == ["step-1/model", "step-1/optim"]
        assert store.list("missing") == []

    def test_delete_and_delete_prefix(self, store):
        for key in ("d/1", "d/2", "e/1"):
            store.write_bytes(key, b"1")
        store.delete(["d/1", "never-existed"])
        assert store.list() == ["d/2", "e/1"]
        store.delete_prefix("d")
        assert store.list() == ["e/1"]

    def test_exclusive_create_has_one_winner(self, store):
        store.write_bytes("lease", b"first", if_absent=True)
        with pytest.raises(StoragePreconditionFailed):
            store.write_bytes("lease", b"second", if_absent=True)
        assert store.read_bytes("lease") == b"first"

    def test_concurrent_exclusive_creates(self, store):
        outcomes = []

        def contend(index):
            try:
                store.write_bytes("race", str(index).encode(), if_absent=True)
                outcomes.append(index)
            except StoragePreconditionFailed:
                pass

        threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(outcomes) == 1
        assert store.read_bytes("race") == str(outcomes[0]).encode()

    def test_readers_never_see_a_partial_object(self, store):
        """Atomic visibility: while a large object is rewritten, reads see old or new, whole."""
        old, new = b"o" * 3_000_000, b"n" * 3_000_000
        store.write_bytes("big", old)
        seen = []
        writer = threading.Thread(target=lambda: store.write_bytes("big", new))
        writer.start()
        while writer.is_alive():
            seen.append(store.read_bytes("big"))
        writer.join()
        seen.append(store.read_bytes("big"))
        assert all(item in (old, new) for item in seen)
        assert seen[-1] == new

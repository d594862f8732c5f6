from __future__ import annotations

import errno
import os

import pytest

from skylift.storage import StorageFullError, open_store
from skylift.storage.local import LocalStore
from tests.storage.conformance import StoreConformance


class TestLocalPath(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return open_store(str(tmp_path / "root"))


class TestFileUrl(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path):
        return open_store(f"file://{tmp_path / 'root'}")


def test_file_url_and_path_are_the_same_store(tmp_path):
    assert isinstance(open_store(f"file://{tmp_path}"), LocalStore)
    assert open_store(f"file://{tmp_path}").url == open_store(str(tmp_path)).url


def test_a_failed_write_leaves_nothing_visible(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    store.write_bytes("kept", b"old")

    def no_space(*_args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StorageFullError, match="no space left writing .*kept"):
        store.write_bytes("kept", b"new")
    monkeypatch.undo()
    assert store.read_bytes("kept") == b"old"
    assert sorted(os.listdir(tmp_path)) == ["kept"]


def test_unsupported_scheme_names_the_supported_ones():
    from skylift.storage import StoragePermanentError

    with pytest.raises(StoragePermanentError, match=r"unsupported scheme 'gs'.*s3://"):
        open_store("gs://bucket/x")

"""A dataset's ``index.json`` cannot make a run write outside ``data.cache_dir``.

The attack of issue 41: an index naming a shard ``./../../planted/evil.pth`` (with the
evil file's true size and sha256, so every check passes) made the shard cache write that
file beside the cache, locally and from S3; a ``.pth`` file in site-packages runs on the
next Python start. A shard name must be a plain file name inside the dataset; any other
is refused before a byte is written, naming the dataset and the name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from skylift.data.shard_cache import ShardCache
from skylift.data.shards import INDEX, ShardInfo, ShardWriter, read_index
from skylift.data.streaming import EvalStream
from skylift.storage import open_store
from skylift.storage.local import LocalStore
from skylift.storage.names import UnsafeNameError

EVIL = b"import os; os.system('echo owned')\n"
TRAVERSAL = "./../../planted/evil.pth"
"""With the cache at ``T/run/cache/<16 hex>``, the cache would write ``T/run/planted/evil.pth``
(its lock file, one level further up for the leading ``.``, at ``T/planted/``)."""

BAD_NAMES = [
    TRAVERSAL,
    "../evil.pth",
    "sub/shard-000000.tar",
    "/etc/evil.pth",
    "..",
    ".",
    "",
    "shard\\..\\evil.pth",
    "shard\x00.tar",
    ".cache.lock",  # the cache's own bookkeeping: a hidden name is not a shard's
]


def _evil_entry() -> dict:
    return {"name": TRAVERSAL, "num_samples": 1, "size": len(EVIL), "sha256": hashlib.sha256(EVIL).hexdigest()}


def _write_dataset(store) -> None:
    """A real dataset whose index also lists the evil name, its size and sha256 true."""
    writer = ShardWriter(store, shard_size_bytes=1 << 20)
    for number in range(4):
        writer.add({"cls": str(number).encode()})
    writer.close()
    payload = json.loads(store.read_bytes(INDEX))
    payload["shards"].append(_evil_entry())
    store.write_bytes(INDEX, json.dumps(payload).encode())


def _cache_dir(tmp_path: Path) -> Path:
    """The cache and the folders the traversal lands in (they exist, as site-packages does)."""
    (tmp_path / "run" / "planted").mkdir(parents=True)
    (tmp_path / "planted").mkdir()
    return tmp_path / "run" / "cache"


def _nothing_outside_the_cache(tmp_path: Path) -> None:
    assert not (tmp_path / "run" / "planted" / "evil.pth").exists(), "the evil file was written outside the cache"
    assert list((tmp_path / "run" / "planted").iterdir()) == []
    assert list((tmp_path / "planted").iterdir()) == []


def _refusal(url: str, cache_dir: Path, tmp_path: Path, endpoint_url: str | None = None) -> str:
    """Stream the dataset; check first that nothing landed outside the cache, then that
    the stream was refused with an UnsafeNameError, and return its message."""
    try:
        _stream(url, cache_dir, endpoint_url)
        error: Exception | None = None
    except Exception as raised:  # whatever it was, the file check comes first
        error = raised
    _nothing_outside_the_cache(tmp_path)
    assert isinstance(error, UnsafeNameError), f"not refused: {error!r}"
    return str(error)


def _stream(url: str, cache_dir: Path, endpoint_url: str | None = None) -> list:
    stream = EvalStream(url, decode=lambda sample: sample["cls"], batch_size=8, cache_dir=str(cache_dir),
                        cache_limit_bytes=1 << 30, collate=list, endpoint_url=endpoint_url)
    return list(stream)


def test_a_local_dataset_naming_a_shard_outside_itself_is_refused_before_any_write(tmp_path):
    # The store three levels deeper than the cache, so the same name reaches the evil
    # file's source there and another folder from the cache.
    dataset = tmp_path / "store" / "one" / "two" / "dataset"
    (tmp_path / "store" / "one" / "planted").mkdir(parents=True)
    (tmp_path / "store" / "one" / "planted" / "evil.pth").write_bytes(EVIL)
    _write_dataset(LocalStore(dataset))
    cache_dir = _cache_dir(tmp_path)
    message = _refusal(str(dataset), cache_dir, tmp_path)
    assert f"{dataset}/index.json" in message and repr(TRAVERSAL) in message, message
    assert "skylift shard" in message, "the fix: rebuild the dataset"


def test_a_dataset_on_s3_naming_a_shard_outside_itself_is_refused_before_any_write(tmp_path, moto_server, s3_bucket):
    url = f"s3://{s3_bucket}/datasets/digits"
    store = open_store(url, endpoint_url=moto_server.endpoint_url)
    # The object the evil name reaches in the bucket, literally (S3 keys are not paths).
    store.write_bytes(TRAVERSAL, EVIL)
    _write_dataset(store)
    cache_dir = _cache_dir(tmp_path)
    message = _refusal(url, cache_dir, tmp_path, endpoint_url=moto_server.endpoint_url)
    assert f"{url}/index.json" in message and repr(TRAVERSAL) in message, message


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_every_name_but_a_plain_file_name_is_refused_by_the_index_reader(tmp_path, name):
    store = LocalStore(tmp_path / "dataset")
    _write_dataset(store)
    payload = json.loads(store.read_bytes(INDEX))
    payload["shards"][-1]["name"] = name
    store.write_bytes(INDEX, json.dumps(payload).encode())
    with pytest.raises(UnsafeNameError, match="index.json: shard name") as refused:
        read_index(store)
    assert str(tmp_path / "dataset") in str(refused.value)
    assert "\n" not in str(refused.value), "one line"


def test_the_shard_cache_refuses_a_shard_outside_its_folder_even_without_the_index(tmp_path):
    """Defence in depth: a ShardInfo built by hand, not read through read_index."""
    source = tmp_path / "store" / "one" / "two" / "dataset"
    source.mkdir(parents=True)  # the kernel walks every component of a "..": it must exist
    (tmp_path / "store" / "one" / "planted").mkdir(parents=True)
    (tmp_path / "store" / "one" / "planted" / "evil.pth").write_bytes(EVIL)
    cache = ShardCache(LocalStore(source), _cache_dir(tmp_path), limit_bytes=1 << 30)
    try:
        cache.read(ShardInfo(**_evil_entry()))
        error: Exception | None = None
    except Exception as raised:
        error = raised
    _nothing_outside_the_cache(tmp_path)
    assert isinstance(error, UnsafeNameError) and "evil.pth" in str(error), f"not refused: {error!r}"


def test_a_well_formed_dataset_still_reads(tmp_path):
    store = LocalStore(tmp_path / "dataset")
    writer = ShardWriter(store, shard_size_bytes=1 << 20)
    for number in range(4):
        writer.add({"cls": str(number).encode()})
    writer.close()
    assert [shard.name for shard in read_index(store).shards] == ["shard-000000.tar"]
    assert _stream(str(tmp_path / "dataset"), tmp_path / "cache") == [[b"0", b"1", b"2", b"3"]]

"""``skylift shard s3://.../train s3://.../shards``: an image folder read from an object store
(moto on 127.0.0.1), fetched in parallel, written in order, resumable after a SIGKILL."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
import threading
import time
from argparse import Namespace
from urllib.parse import urlsplit

import pytest

from skylift.cli.main import main
from skylift.data.image_sources import fetch_ordered
from skylift.data.shards import read_index, read_shard_samples
from skylift.storage import open_store
from tests.conftest import REPO_ROOT
from tests.servers import FaultyProxy

CLASSES = ["cat", "dog", "owl"]
SMALL_SHARDS = ("--shard-size-mib", "0.01")  # ~10 KiB: several shards from 30 small images


def _image_tree() -> dict[str, bytes]:
    """3 classes x 10 noise images (PNG and JPEG, 8-40 px), plus objects the layout skips."""
    from PIL import Image

    rng = random.Random(7)
    tree = {}
    for name in CLASSES:
        for number in range(10):
            side = rng.randint(8, 40)
            image = Image.frombytes("RGB", (side, side + number), rng.randbytes(side * (side + number) * 3))
            buffer = io.BytesIO()
            suffix = (".png", ".jpg", ".JPEG")[number % 3]
            image.save(buffer, format="PNG" if suffix == ".png" else "JPEG", quality=90)
            tree[f"{name}/{number:02d}{suffix}"] = buffer.getvalue()
    tree["cat/notes.txt"] = b"not an image"
    tree["dog/nested/deeper.png"] = tree["dog/00.png"]  # not directly in the class folder
    tree["LICENSE"] = b"beside the class folders"
    return tree


TREE = _image_tree()


def _expected() -> list[tuple[int, str, bytes]]:
    """(label, field, bytes) of every image, in the order they must be written."""
    expected = []
    for label, name in enumerate(CLASSES):
        for key in sorted(k for k in TREE if k.startswith(f"{name}/") and k.count("/") == 1):
            suffix = key.rsplit(".", 1)[1].lower()
            if suffix != "txt":
                expected.append((label, suffix.replace("jpeg", "jpg"), TREE[key]))
    return expected


def _upload(moto_server, bucket: str, prefix: str, tree: dict[str, bytes]) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=moto_server.endpoint_url, region_name="us-east-1")
    for key, data in tree.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)
    return f"s3://{bucket}/{prefix}"


def _samples(store) -> list[dict[str, bytes]]:
    return [sample for shard in read_index(store).shards for sample in read_shard_samples(store.read_bytes(shard.name))]


def test_an_s3_image_folder_round_trips_every_image(moto_server, s3_bucket, capsys):
    source = _upload(moto_server, s3_bucket, "imagenet/train", TREE)
    dest = f"s3://{s3_bucket}/imagenet-shards/train"
    endpoint = ("--endpoint-url", moto_server.endpoint_url)  # source and destination alike
    # In this process: what `shard` writes and prints is under test, not a process start
    # (the killed run below is a real process).
    capsys.readouterr()
    code = main(["shard", source, dest, *SMALL_SHARDS, "--workers", "4", *endpoint, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    [output] = json.loads(out)
    store = open_store(dest, endpoint_url=moto_server.endpoint_url)
    index = read_index(store)
    assert output == {"dest": dest, "samples": 30, "shards": len(index.shards), "reused_shards": 0,
                      "bytes": sum(shard.size for shard in index.shards)}  # fmt: skip
    assert len(index.shards) >= 5
    assert index.metadata == {"classes": CLASSES} and index.fields == ["cls", "jpg", "png"]
    written = [(int(sample.pop("cls")), *sample.popitem()) for sample in _samples(store)]
    assert written == _expected()


def test_a_local_copy_and_the_s3_copy_give_the_same_shards(moto_server, s3_bucket, tmp_path, capsys):
    """The order and bytes depend only on the tree, not on where it is or how many workers read it."""
    for key, data in TREE.items():
        (tmp_path / "train" / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "train" / key).write_bytes(data)
    source = _upload(moto_server, s3_bucket, "train", TREE)
    assert main(["shard", str(tmp_path / "train"), str(tmp_path / "local"), *SMALL_SHARDS, "--json"]) == 0
    into_s3 = ["shard", source, f"s3://{s3_bucket}/shards", *SMALL_SHARDS, "--workers", "16", "--json"]
    assert main([*into_s3, "--endpoint-url", moto_server.endpoint_url]) == 0
    capsys.readouterr()
    local = read_index(open_store(str(tmp_path / "local")))
    remote = read_index(open_store(f"s3://{s3_bucket}/shards", endpoint_url=moto_server.endpoint_url))
    assert local == remote and local.num_samples == 30


def test_the_progress_total_is_the_number_of_images(moto_server, s3_bucket):
    from skylift.cli.shard import _splits

    source = _upload(moto_server, s3_bucket, "train", TREE)
    args = Namespace(source=source, dest="out", endpoint_url=moto_server.endpoint_url, source_endpoint_url=None,
                     workers=None)  # fmt: skip
    [(split, _, metadata, total)] = _splits(args)
    assert (split, metadata, total) == ("", {"classes": CLASSES}, 30)


class HoldingProxy(FaultyProxy):
    """Relays to moto, but holds the upload of the shard named ``hold`` until released, then drops it."""

    def __init__(self, upstream_port: int, hold: str) -> None:
        self.hold, self.held, self.released = hold, threading.Event(), threading.Event()
        super().__init__(upstream_port)

    def take_fault(self, method: str, path: str) -> tuple[str, int, object] | None:
        if method == "PUT" and urlsplit(path).path.endswith(f"/{self.hold}"):
            self.held.set()
            self.released.wait(60)
            return ("drop", 0, None)
        return super().take_fault(method, path)


def test_a_killed_run_resumes_keeping_the_shards_it_wrote(moto_server, s3_bucket, tmp_path, capsys):
    source = _upload(moto_server, s3_bucket, "imagenet/train", TREE)
    reference = f"s3://{s3_bucket}/reference"
    assert main(["shard", source, reference, *SMALL_SHARDS, "--endpoint-url", moto_server.endpoint_url, "--json"]) == 0
    capsys.readouterr()
    expected_index = open_store(reference, endpoint_url=moto_server.endpoint_url).read_bytes("index.json")

    dest = f"s3://{s3_bucket}/imagenet-shards/train"
    proxy = HoldingProxy(moto_server.port, hold="shard-000003.tar")
    command = [sys.executable, "-m", "skylift", "shard", source, dest, *SMALL_SHARDS, "--workers", "8"]
    log = tmp_path / "killed.log"
    try:
        with open(log, "w") as stderr:
            process = subprocess.Popen([*command, "--endpoint-url", proxy.endpoint_url], cwd=REPO_ROOT,
                                       stdout=subprocess.DEVNULL, stderr=stderr)  # fmt: skip
        try:
            assert proxy.held.wait(120), log.read_text()
            assert process.poll() is None
            process.kill()  # SIGKILL while shard 3 is on its way up
            assert process.wait(30) == -9
        finally:
            process.kill()
            proxy.released.set()
    finally:
        time.sleep(0.1)  # the held request drops its connection
        proxy.close()

    store = open_store(dest, endpoint_url=moto_server.endpoint_url)
    assert store.list() == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]  # no index: not done
    capsys.readouterr()
    code = main(["shard", source, dest, *SMALL_SHARDS, "--endpoint-url", moto_server.endpoint_url])  # the rerun
    rerun = capsys.readouterr()
    assert code == 0, rerun.err
    assert f"{dest}: 30 samples in " in rerun.out and "; 3 already there)" in rerun.out
    assert store.read_bytes("index.json") == expected_index


@pytest.mark.parametrize(
    ("tree", "problem"),
    [
        ({}, "has no class folders (nothing is stored under it)"),
        ({"a.png": b"x", "b.jpg": b"y"}, "has no class folders;"),
        ({"cat/": b"", "dog/readme.txt": b"x", "dog/deep/a.png": b"x"}, "has 2 class folders (cat, dog) but no images"),
    ],
    ids=["empty-prefix", "images-but-no-class-folders", "class-folders-but-no-images"],
)
def test_a_source_not_in_the_layout_is_named(moto_server, s3_bucket, capsys, tree, problem):
    source = _upload(moto_server, s3_bucket, "train", tree)
    dest = f"s3://{s3_bucket}/shards"
    assert main(["shard", source, dest, "--endpoint-url", moto_server.endpoint_url]) == 2
    error = capsys.readouterr().err
    assert f"shard source {source} {problem}" in error
    assert f"the layout is {source}/<class name>/<image files> (.jpg, .jpeg, .png" in error
    assert open_store(dest, endpoint_url=moto_server.endpoint_url).list() == []


def test_a_missing_bucket_is_a_configuration_error(moto_server, s3_bucket, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["shard", "s3://no-such-bucket/train", out, "--endpoint-url", moto_server.endpoint_url]) == 2
    assert "bucket 'no-such-bucket' does not exist" in capsys.readouterr().err


def test_a_missing_s3_extra_names_the_pip_command(monkeypatch, tmp_path, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "boto3" else real_find_spec(name))
    assert main(["shard", "s3://bucket/imagenet/train", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "shard source s3://bucket/imagenet/train: s3:// needs boto3" in error
    assert "pip install 'skylift[s3]'" in error


@pytest.mark.parametrize(
    ("source", "dest", "source_endpoint", "expected"),
    [
        ("s3://b/train", "s3://b/shards", None, "http://dest"),  # one store: one endpoint
        ("s3://b/train", "/tmp/shards", None, "http://dest"),  # only the source is an object store
        ("s3://b/train", "oss://b/shards", None, None),  # another store: its own endpoint (or environment)
        ("s3://b/train", "oss://b/shards", "http://source", "http://source"),
    ],
)
def test_which_endpoint_the_source_uses(source, dest, source_endpoint, expected):
    from skylift.cli.shard import _source_endpoint

    args = Namespace(source=source, dest=dest, endpoint_url="http://dest", source_endpoint_url=source_endpoint)
    assert _source_endpoint(args) == expected


def test_fetches_run_in_parallel_but_come_back_in_order_and_bounded():
    started, consumed, in_flight, most = [0], [0], [0], [0]
    lock = threading.Lock()

    def read(key: str) -> str:
        with lock:
            started[0] += 1
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        time.sleep(random.uniform(0, 0.004))
        with lock:
            in_flight[0] -= 1
        return key.upper()

    keys = [f"k{number:03d}" for number in range(200)]
    for key, result in zip(keys, fetch_ordered(read, keys, workers=8), strict=True):
        assert result == key.upper()
        consumed[0] += 1
        assert started[0] - consumed[0] <= 16  # at most 2 x workers read ahead of the writer
    assert 1 < most[0] <= 8


def test_a_failed_fetch_stops_at_its_place_in_the_order():
    def read(key: str) -> str:
        if key == "k5":
            raise OSError("gone")
        return key

    results = fetch_ordered(read, [f"k{number}" for number in range(50)], workers=4)
    assert [next(results) for _ in range(5)] == [f"k{number}" for number in range(5)]
    with pytest.raises(OSError, match="gone"):
        next(results)

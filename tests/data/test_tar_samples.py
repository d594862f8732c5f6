"""The header-only tar reader the streaming dataset uses agrees with tarfile on any tar."""

from __future__ import annotations

import io
import random
import tarfile

import pytest

from skylift.data.shards import ShardWriter, read_shard_samples
from skylift.data.streaming import TarSamples
from skylift.storage.local import LocalStore


def test_matches_tarfile_on_shards_the_writer_made(tmp_path):
    rng = random.Random(0)
    writer = ShardWriter(LocalStore(str(tmp_path)), shard_size_bytes=64 * 1024)
    for index in range(60):
        writer.add({"jpg": rng.randbytes(rng.randint(0, 5000)), "cls": str(index % 3).encode(), "meta.json": b"{}"})
    for shard in writer.close().shards:
        data = (tmp_path / shard.name).read_bytes()
        samples = TarSamples(data)
        assert samples._parsed is None  # the fast path, not the fallback
        assert list(samples) == list(read_shard_samples(data))


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
@pytest.mark.parametrize("stem", ["short", "p" * 120 + "/" + "b" * 50, "c" * 300])
def test_matches_tarfile_on_other_formats_folders_and_long_names(tar_format, stem):
    buffer = io.BytesIO()
    try:
        with tarfile.open(fileobj=buffer, mode="w", format=tar_format) as archive:
            folder = tarfile.TarInfo("folder")
            folder.type = tarfile.DIRTYPE
            archive.addfile(folder)
            for key in range(3):
                for field in ("jpg", "cls"):
                    payload = f"{key}{field}".encode() * (key + 1)
                    member = tarfile.TarInfo(f"{stem}{key}.{field}")
                    member.size = len(payload)
                    archive.addfile(member, io.BytesIO(payload))
    except ValueError:
        pytest.skip("this format cannot hold the name")
    data = buffer.getvalue()
    assert list(TarSamples(data)) == list(read_shard_samples(data))
    assert len(TarSamples(data)) == 3

from __future__ import annotations

import pytest

from skylift.storage import open_store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    """An empty checkpoint root: a local folder, or a prefix on the moto S3 server."""
    if request.param == "local":
        return open_store(str(tmp_path / "root"))
    moto_server = request.getfixturevalue("moto_server")
    bucket = request.getfixturevalue("s3_bucket")
    return open_store(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)

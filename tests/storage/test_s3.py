"""S3 through a real moto server on 127.0.0.1, over HTTP."""

from __future__ import annotations

import pytest

from skylift.storage import RetryPolicy, StoragePermanentError, StorageTransientError, open_store
from tests.servers import SENTINEL_KEY_ID, SENTINEL_SECRET, SENTINEL_TOKEN, FaultyProxy
from tests.storage.conformance import StoreConformance

FAST_RETRY = dict(base_delay_s=0.01, max_delay_s=0.05, deadline_s=20.0)


class TestS3(StoreConformance):
    @pytest.fixture
    def store(self, moto_server, s3_bucket):
        return open_store(f"s3://{s3_bucket}/prefix", endpoint_url=moto_server.endpoint_url)


class TestS3BucketRoot(StoreConformance):
    @pytest.fixture
    def store(self, moto_server, s3_bucket):
        return open_store(f"s3://{s3_bucket}", endpoint_url=moto_server.endpoint_url)


class TestOssThroughS3Api(StoreConformance):
    """oss:// and cos:// speak the S3 API at their endpoint (here the loopback server)."""

    @pytest.fixture
    def store(self, moto_server, s3_bucket, monkeypatch):
        monkeypatch.setenv("SKYLIFT_OSS_ENDPOINT_URL", moto_server.endpoint_url)
        # A bucket name cannot prefix 127.0.0.1 as a virtual host: path style, as for MinIO.
        monkeypatch.setenv("SKYLIFT_S3_ADDRESSING_STYLE", "path")
        return open_store(f"oss://{s3_bucket}/run")


def test_oss_without_endpoint_says_what_to_set(monkeypatch):
    for name in ("SKYLIFT_OSS_ENDPOINT_URL", "OSS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StoragePermanentError, match="SKYLIFT_OSS_ENDPOINT_URL"):
        open_store("oss://bucket/run")


@pytest.fixture
def proxy(moto_server):
    proxy = FaultyProxy(moto_server.port)
    yield proxy
    proxy.close()


@pytest.mark.parametrize("fault", ["fail_500", "fail_503", "drop", "truncate"])
def test_transient_faults_are_retried(proxy, s3_bucket, fault):
    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=proxy.endpoint_url, retry=RetryPolicy(**FAST_RETRY))
    store.write_bytes("object", b"x" * 1000)
    {"fail_500": lambda: proxy.fail(3, 500), "fail_503": lambda: proxy.fail(3, 503),
     "drop": lambda: proxy.drop(3), "truncate": lambda: proxy.truncate(3)}[fault]()
    assert store.read_bytes("object") == b"x" * 1000
    assert proxy.faults_injected == 3
    assert len(store.retry.attempts_log) == 3


def test_streamed_write_is_retried_without_reading_its_chunks_again(proxy, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=proxy.endpoint_url, retry=RetryPolicy(**FAST_RETRY))
    passes = []

    def chunks():
        passes.append(1)
        yield b"a" * 5000
        yield b"b" * 5000

    proxy.fail(2, 503)
    store.write_chunks("streamed", chunks)
    assert store.read_bytes("streamed") == b"a" * 5000 + b"b" * 5000
    assert len(passes) == 1 and len(store.retry.attempts_log) == 2


def test_a_streamed_object_larger_than_a_part_goes_up_in_parts(moto_server, s3_bucket):
    import boto3

    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=moto_server.endpoint_url)
    store.part_bytes = 5 * 1024**2  # S3's smallest part
    chunk = bytes(range(256)) * 4096  # 1 MiB
    store.write_chunks("big", lambda: iter([chunk] * 12))
    head = boto3.client("s3", endpoint_url=moto_server.endpoint_url).head_object(Bucket=s3_bucket, Key="r/big")
    # A multipart object's ETag ends in its part count: 5 + 5 + 2 MiB.
    assert head["ETag"].strip('"').endswith("-3")
    assert store.read_bytes("big") == chunk * 12


def test_chunks_are_regrouped_into_parts_of_the_part_size():
    from skylift.storage.s3 import _parts

    assert list(_parts([b"abc", memoryview(b"defg"), b"", b"hi"], 4)) == [b"abcd", b"efgh", b"i"]
    assert list(_parts([b"abcd"], 4)) == [b"abcd"]
    assert list(_parts([], 4)) == []


def test_a_failed_part_is_retried_alone_and_the_chunks_are_read_once(proxy, s3_bucket):
    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=proxy.endpoint_url, retry=RetryPolicy(**FAST_RETRY))
    store.part_bytes = 5 * 1024**2
    chunk, passes = bytes(range(256)) * 4096, []

    def chunks():
        passes.append(1)
        yield from [chunk] * 12

    proxy.fail(2, 503, when=lambda method, path: method == "PUT" and "partNumber=2" in path)
    store.write_chunks("big", chunks)
    assert store.read_bytes("big") == chunk * 12
    assert proxy.faults_injected == 2 and len(store.retry.attempts_log) == 2
    assert passes == [1]


def test_an_upload_that_fails_for_good_is_aborted(proxy, moto_server, s3_bucket):
    import boto3

    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=proxy.endpoint_url, retry=RetryPolicy(**FAST_RETRY))
    store.part_bytes = 5 * 1024**2
    proxy.fail(1, 403, when=lambda method, path: method == "PUT" and "partNumber=3" in path)
    with pytest.raises(StoragePermanentError, match="access denied"):
        store.write_chunks("denied", lambda: iter([bytes(1024**2)] * 12))
    client = boto3.client("s3", endpoint_url=moto_server.endpoint_url)
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")
    assert not store.exists("denied")


def test_retries_give_up_with_a_typed_error(proxy, s3_bucket):
    retry = RetryPolicy(max_attempts=3, **FAST_RETRY)
    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=proxy.endpoint_url, retry=retry)
    proxy.fail(10, 503)
    with pytest.raises(StorageTransientError, match="after 3 attempts"):
        store.write_bytes("object", b"data")


def test_server_restart_mid_write_is_survived(moto_server, s3_bucket):
    retry = RetryPolicy(max_attempts=20, base_delay_s=0.1, max_delay_s=0.5, deadline_s=30.0)
    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=moto_server.endpoint_url, retry=retry)
    store.write_bytes("before", b"1")
    restarted = moto_server.restart_after(1.0)
    store.write_bytes("during", b"2" * 100_000)
    restarted.join()
    assert store.read_bytes("during") == b"2" * 100_000
    assert store.read_bytes("before") == b"1"
    assert store.retry.attempts_log


def test_missing_bucket_fails_at_once_and_names_it(moto_server):
    retry = RetryPolicy(**FAST_RETRY)
    store = open_store("s3://no-such-bucket/x", endpoint_url=moto_server.endpoint_url, retry=retry)
    with pytest.raises(StoragePermanentError, match=r"bucket 'no-such-bucket' does not exist.*aws s3 mb"):
        store.write_bytes("k", b"v")
    assert retry.attempts_log == []


def test_access_denied_fails_at_once_without_secrets(proxy, s3_bucket):
    retry = RetryPolicy(**FAST_RETRY)
    store = open_store(f"s3://{s3_bucket}/r", endpoint_url=proxy.endpoint_url, retry=retry)
    proxy.fail(1, 403)
    with pytest.raises(StoragePermanentError) as caught:
        store.read_bytes("k")
    message = str(caught.value)
    assert "access denied" in message and s3_bucket in message
    for secret in (SENTINEL_KEY_ID, SENTINEL_SECRET, SENTINEL_TOKEN):
        assert secret not in message
    assert retry.attempts_log == []


def test_backoff_is_capped_exponential_with_full_jitter():
    from skylift.storage.errors import StorageTransientError as Transient

    sleeps, clock = [], [0.0]
    policy = RetryPolicy(
        max_attempts=6, base_delay_s=1.0, max_delay_s=4.0, deadline_s=1000.0,
        sleep=lambda s: (sleeps.append(s), clock.__setitem__(0, clock[0] + s)),
        clock=lambda: clock[0], uniform=lambda low, high: high,
    )
    calls = []

    def flaky():
        calls.append(1)
        raise Transient("503")

    with pytest.raises(Transient):
        policy.run(flaky, what="op")
    assert sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert len(calls) == 6


def test_deadline_stops_retrying_early():
    from skylift.storage.errors import StorageTransientError as Transient

    clock = [0.0]
    policy = RetryPolicy(
        max_attempts=100, base_delay_s=1.0, max_delay_s=8.0, deadline_s=10.0,
        sleep=lambda s: clock.__setitem__(0, clock[0] + s), clock=lambda: clock[0], uniform=lambda low, high: high,
    )
    with pytest.raises(Transient, match="after 4 attempts"):
        policy.run(lambda: (_ for _ in ()).throw(Transient("x")), what="op")

"""The instance type comes from the metadata service only on a detected cloud."""

from __future__ import annotations

import pytest

from skylift.cloud import _protocol
from skylift.cloud.vendors import cloud_names
from skylift.doctor.instance import gather_cloud
from tests.doctor.metadata import INSTANCE_TYPES, InstanceMetadataServer


@pytest.fixture
def server():
    with InstanceMetadataServer() as running:
        yield running


@pytest.mark.parametrize("cloud", cloud_names())
def test_each_cloud_answers_its_instance_type(cloud, server, monkeypatch):
    monkeypatch.setenv("SKYLIFT_CLOUD", cloud)
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", server.url)
    facts = gather_cloud()
    assert (facts.name, facts.source, facts.instance_type) == (cloud, "SKYLIFT_CLOUD", INSTANCE_TYPES[cloud])
    assert facts.instance_type_error is None


class MetadataAsked(AssertionError):
    pass


@pytest.fixture
def refuse_every_metadata_request(monkeypatch):
    """Every metadata request (a vendor's headers or its tokens) goes through
    ``_protocol.http_request``: refuse there, not at a name the doctor happens to use."""

    def refuse(url, **kwargs):
        raise MetadataAsked(f"metadata asked: {url}")

    monkeypatch.setattr(_protocol, "http_request", refuse)


def test_off_cloud_the_metadata_service_is_never_asked(monkeypatch, tmp_path, refuse_every_metadata_request):
    monkeypatch.delenv("SKYLIFT_CLOUD", raising=False)
    monkeypatch.setattr("skylift.cloud.notice.DMI_DIR", tmp_path)  # a machine with no cloud's DMI strings
    facts = gather_cloud()
    assert facts.name is None and facts.instance_type is None and facts.instance_type_error is None


@pytest.mark.parametrize("cloud", cloud_names())
def test_on_a_cloud_the_request_reaches_the_refusing_function(cloud, monkeypatch, refuse_every_metadata_request):
    """The control of the test above: on each cloud the doctor's request does pass
    through the function refused there, so its silence off-cloud means something."""
    monkeypatch.setenv("SKYLIFT_CLOUD", cloud)
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", "http://127.0.0.1:9")
    assert gather_cloud().instance_type_error.startswith("MetadataAsked: metadata asked: http://127.0.0.1:9")


def test_a_silent_metadata_service_is_a_reported_fact_not_a_crash(server, monkeypatch):
    monkeypatch.setenv("SKYLIFT_CLOUD", "azure")
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", server.url)
    server.fail_next(5)
    facts = gather_cloud(timeout_s=0.5)
    assert facts.name == "azure" and facts.instance_type is None
    assert "503" in facts.instance_type_error

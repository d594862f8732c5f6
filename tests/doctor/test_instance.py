"""The instance type comes from the metadata service only on a detected cloud."""

from __future__ import annotations

import pytest

from skylift.cloud.notice import CLOUDS
from skylift.doctor import instance
from skylift.doctor.instance import gather_cloud
from tests.doctor.metadata import INSTANCE_TYPES, InstanceMetadataServer


@pytest.fixture
def server():
    with InstanceMetadataServer() as running:
        yield running


@pytest.mark.parametrize("cloud", CLOUDS)
def test_each_cloud_answers_its_instance_type(cloud, server, monkeypatch):
    monkeypatch.setenv("SKYLIFT_CLOUD", cloud)
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", server.url)
    facts = gather_cloud()
    assert (facts.name, facts.source, facts.instance_type) == (cloud, "SKYLIFT_CLOUD", INSTANCE_TYPES[cloud])
    assert facts.instance_type_error is None


def test_off_cloud_the_metadata_service_is_never_asked(monkeypatch, tmp_path):
    monkeypatch.delenv("SKYLIFT_CLOUD", raising=False)
    monkeypatch.setattr(instance, "detect_cloud", lambda: None)

    def refuse(*args, **kwargs):
        raise AssertionError("metadata probed off-cloud")

    monkeypatch.setattr(instance, "http_request", refuse)
    assert gather_cloud().name is None


def test_a_silent_metadata_service_is_a_reported_fact_not_a_crash(server, monkeypatch):
    monkeypatch.setenv("SKYLIFT_CLOUD", "azure")
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", server.url)
    server.fail_next(5)
    facts = gather_cloud(timeout_s=0.5)
    assert facts.name == "azure" and facts.instance_type is None
    assert "503" in facts.instance_type_error

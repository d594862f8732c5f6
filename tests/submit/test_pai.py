"""PAI-DLC CreateJob: the official SDK client sends a real signed request to a loopback
server that records it."""

from __future__ import annotations

import pytest

from skylift.submit import pai
from tests.submit.conftest import ALIBABA_KEY_ID, ALIBABA_SECRET, make_job
from tests.submit.recording import RecordingServer


@pytest.fixture
def dlc_server():
    server = RecordingServer(lambda request: (200, {"JobId": "dlc1a2b3c4d", "RequestId": "req-1"}))
    yield server
    server.close()


def _send(job, server):
    from skylift.config.submit import SubmitConfig

    options = SubmitConfig.model_validate({**job.options.model_dump(), "pai": {"endpoint": server.endpoint}})
    return pai.send(pai.build(job), options)


def test_the_sdk_sends_a_signed_create_job_with_our_body(dlc_server, vendor_credentials):
    job = make_job("pai")
    ref = _send(job, dlc_server)
    assert str(ref) == "pai:cn-hangzhou:dlc1a2b3c4d"
    [recorded] = dlc_server.requests
    assert (recorded.method, recorded.path) == ("POST", "/api/v1/jobs")
    assert recorded.headers["x-acs-action"] == "CreateJob"
    assert recorded.headers["x-acs-version"] == "2020-12-03"
    assert recorded.headers["authorization"].startswith(f"ACS3-HMAC-SHA256 Credential={ALIBABA_KEY_ID},")
    assert ALIBABA_SECRET.encode() not in recorded.body
    body = recorded.json()
    expected = pai.build(job).body
    for key in ("DisplayName", "JobType", "UserCommand", "DataSources", "Envs", "Settings", "JobMaxRunningTimeMinutes"):
        assert body[key] == expected[key], key
    [spec] = body["JobSpecs"]
    assert {key: spec[key] for key in expected["JobSpecs"][0]} == expected["JobSpecs"][0]


def test_the_job_spec_asks_for_spot_with_one_limit_and_mounts_the_store():
    body = pai.build(make_job("pai", submit={"pai": {"spot_price_limit_cny_per_minute": 0.05}})).body
    [spec] = body["JobSpecs"]
    assert body["JobType"] == "PyTorchJob"
    assert spec["UseSpotInstance"] is True
    assert spec["SpotSpec"] == {"SpotStrategy": "SpotWithPriceLimit", "SpotPriceLimit": 0.05}
    mounts = {source["MountPath"]: source for source in body["DataSources"]}
    assert mounts[pai.CHECKPOINT_MOUNT] == {"Uri": "oss://bucket-1250000000/runs/quick/",
                                            "MountPath": pai.CHECKPOINT_MOUNT, "MountAccess": "RW"}
    assert "--set checkpoint.root=/mnt/skylift/checkpoints" in body["UserCommand"]
    assert "--set data.url=/mnt/skylift/data/train" in body["UserCommand"]


def test_both_spot_limits_are_refused():
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match="not both"):
        make_job("pai", submit={"pai": {"spot_price_limit_cny_per_minute": 0.05, "spot_discount_limit": 0.5}})


def test_the_request_round_trips_through_the_sdk_models():
    from alibabacloud_pai_dlc20201203 import models

    body = pai.build(make_job("pai")).body
    mapped = models.CreateJobRequest().from_map(body).to_map()
    for key, value in body.items():
        if key != "JobSpecs":
            assert mapped[key] == value, key
    assert mapped["JobSpecs"][0]["SpotSpec"] == body["JobSpecs"][0]["SpotSpec"]


def test_workers_save_before_the_reclaimed_instance_is_released():
    body = pai.build(make_job("pai")).body
    assert body["Settings"]["TerminationGracePeriodSeconds"] == 300
    assert "--set preemption.grace_s=290" in body["UserCommand"]

"""TI-ONE CreateTrainingTask: the SDK's models load our JSON with unknown-field warnings
as errors, and the official client sends a real TC3-signed request to a loopback server."""

from __future__ import annotations

import json
import warnings

import pytest

from skylift.submit import tione
from tests.submit.conftest import TENCENT_KEY_ID, TENCENT_SECRET, make_job
from tests.submit.recording import RecordingServer


def _load_strictly(body: dict):
    from tencentcloud.tione.v20211111 import models

    request = models.CreateTrainingTaskRequest()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "<key> fileds are useless." for an unknown key
        request.from_json_string(json.dumps(body))
    return request


def test_every_field_is_known_to_the_sdk_model():
    body = tione.build(make_job("tione")).body
    request = _load_strictly(body)
    assert request.TrainingMode == "DDP"
    assert request.ResourceSupplyAttribute.SupplyType == "SPOT"
    assert request.ImageInfo.ImageType == "CUSTOM"
    assert request.ResourceConfigInfos[0].InstanceNum == 2
    assert [config.COSSource.Bucket for config in request.DataConfigs] == ["bucket-1250000000"] * 2
    assert _without_nulls(json.loads(request.to_json_string())) == body


def _without_nulls(value):
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def test_a_misspelled_field_is_caught():
    body = {**tione.build(make_job("tione")).body, "StartCmd": "oops"}
    with pytest.raises(UserWarning, match="StartCmd"):
        _load_strictly(body)


def test_on_demand_has_no_supply_attribute():
    assert "ResourceSupplyAttribute" not in tione.build(make_job("tione", submit={"spot": False})).body


def test_the_sdk_sends_a_signed_request_with_our_body(vendor_credentials):
    from skylift.config.submit import SubmitConfig

    server = RecordingServer(lambda request: (200, {"Response": {"Id": "train-51234", "RequestId": "r-1"}}))
    try:
        job = make_job("tione")
        options = SubmitConfig.model_validate({**job.options.model_dump(), "tione": {"endpoint": server.endpoint}})
        ref = tione.send(tione.build(job), options)
    finally:
        server.close()
    assert str(ref) == "tione:ap-guangzhou:train-51234"
    [recorded] = server.requests
    assert (recorded.method, recorded.path) == ("POST", "/")
    assert recorded.headers["x-tc-action"] == "CreateTrainingTask"
    assert recorded.headers["x-tc-version"] == "2021-11-11"
    assert recorded.headers["x-tc-region"] == "ap-guangzhou"
    assert recorded.headers["authorization"].startswith(f"TC3-HMAC-SHA256 Credential={TENCENT_KEY_ID}/")
    assert TENCENT_SECRET.encode() not in recorded.body
    assert recorded.json() == tione.build(job).body


def test_a_cos_checkpoint_root_without_a_key_source_is_refused_naming_the_field_and_the_fix():
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError) as caught:
        tione.build(make_job("tione", submit={"tione": {}}))
    message = str(caught.value)
    assert "submit.tione.cos_keys_from: is not set" in message
    assert "cos://bucket-1250000000/runs/quick" in message and "no role field" in message
    assert "--set submit.tione.cos_keys_from=image" in message


def test_the_cli_refuses_before_sending_and_says_the_next_command(capsys, vendor_credentials):
    from skylift.cli.main import main

    argv = ["submit", "examples/quickstart.yaml", "--platform", "tione", "--image", "registry.example.com/s:1",
            "--instance", "TI.GN7.2XLARGE32.POST", "--region", "ap-guangzhou", "--spot",
            "--set", "checkpoint.root=cos://bucket-1250000000/ckpt", "--set", "submit.tione.endpoint=http://127.0.0.1:9"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "submit.tione.cos_keys_from" in error
    assert error.rstrip().endswith("--set submit.tione.cos_keys_from=image")


def test_with_the_image_as_key_source_the_request_carries_no_key(vendor_credentials):
    body = tione.build(make_job("tione")).body
    names = {env["Name"] for env in body["Envs"]}
    assert names == {"SKYLIFT_PLATFORM", "SKYLIFT_COS_ENDPOINT_URL"}
    text = json.dumps(body)
    assert TENCENT_SECRET not in text and TENCENT_KEY_ID not in text


def test_every_submit_env_is_sent_private_whatever_its_name():
    """TI-ONE hides an ``IsPrivate`` value in its console: every ``submit.envs`` value is secret."""
    body = tione.build(make_job("tione", submit={"envs": {"NOTE": "sk-test-123", "WANDB_PROJECT": "k"}})).body
    private = {env["Name"]: env["IsPrivate"] for env in body["Envs"]}
    assert private == {"SKYLIFT_PLATFORM": False, "SKYLIFT_COS_ENDPOINT_URL": False, "NOTE": True,
                       "WANDB_PROJECT": True}  # a secret-looking name is refused (test_secret_envs.py)

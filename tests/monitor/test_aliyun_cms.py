"""Alibaba Cloud CloudMonitor: the official SDK (alibabacloud-cms20190101) sends real,
ACS3-signed ``PutCustomMetric`` requests to a loopback server that records them.

The signature is recomputed here from the recorded request and the test's secret, so it is
known to be made with the credential chain's key; the secret itself appears nowhere in
the request, the logs or the output.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections import deque
from urllib.parse import parse_qsl, quote, urlsplit

import pytest

from skylift.monitor.exporters import RunInfo
from skylift.monitor.exporters.aliyun_cms import AliyunCmsExporter, CloudMonitorError, metric_list
from tests.checkpoint.runs import records, train
from tests.servers import free_port
from tests.submit.conftest import ALIBABA_KEY_ID, ALIBABA_SECRET
from tests.submit.recording import Recorded, RecordingServer

KEY_ID, SECRET = ALIBABA_KEY_ID, ALIBABA_SECRET
"""The submit tests' sentinels: the credentials package reads the environment once, when it is
first imported, so every test of the session that imports it must see the same values."""
CREDENTIALS = {
    "ALIBABA_CLOUD_ACCESS_KEY_ID": KEY_ID,
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET": SECRET,
    "ALIBABA_CLOUD_ECS_METADATA_DISABLED": "true",  # no instance metadata lookups
}
_AUTH_UTIL = {
    "ALIBABA_CLOUD_ACCESS_KEY_ID": "environment_access_key_id",
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET": "environment_access_key_secret",
    "ALIBABA_CLOUD_SECURITY_TOKEN": "environment_security_token",
    "ALIBABA_CLOUD_ECS_METADATA_DISABLED": "environment_ecs_metadata_disabled",
    "ALIBABA_CLOUD_CREDENTIALS_FILE": "environment_credentials_file",
    "ALIBABA_CLOUD_PROFILE": "environment_profile_name",
    "ALIBABA_CLOUD_OIDC_TOKEN_FILE": "environment_oidc_token_file",
    "ALIBABA_CLOUD_ROLE_ARN": "environment_role_arn",
    "ALIBABA_CLOUD_OIDC_PROVIDER_ARN": "environment_oidc_provider_arn",
    "ALIBABA_CLOUD_CREDENTIALS_URI": "environment_credentials_uri",
}
"""Environment variable -> where ``alibabacloud_credentials`` keeps what it read at import."""
ACCEPTED = (200, {"Code": "200", "Message": "", "RequestId": "req-ok"})


def _alibaba_environment(monkeypatch, values: dict[str, str]) -> None:
    """Exactly ``values`` among the credential chain's variables, as the chain will read them."""
    for name in (*_AUTH_UTIL, "ALIBABA_CLOUD_REGION_ID"):
        if name in values:
            monkeypatch.setenv(name, values[name])
        else:
            monkeypatch.delenv(name, raising=False)
    from alibabacloud_credentials.utils import auth_util  # a first import reads them here

    for name, attribute in _AUTH_UTIL.items():
        monkeypatch.setattr(auth_util, attribute, values.get(name))
    monkeypatch.setattr(auth_util, "enable_oidc_credential", False)


@pytest.fixture
def credentials(monkeypatch):
    """Fake Alibaba Cloud credentials in the environment, where the vendor chain reads them."""
    _alibaba_environment(monkeypatch, CREDENTIALS)


@pytest.fixture
def cms_server():
    """Answers the scripted (status, body) pairs first, then accepts every batch."""
    script: deque[tuple[int, dict]] = deque()
    server = RecordingServer(lambda request: script.popleft() if script else ACCEPTED)
    server.script = script
    yield server
    server.close()


def _exporter(tmp_path, endpoint: str, *overrides: str) -> tuple[AliyunCmsExporter, RunInfo]:
    from skylift.config.load import load_config

    config = load_config("examples/quickstart.yaml", [
        f"run_dir={tmp_path / 'cms-run'}", "monitor.exporters=[aliyun_cms]", "monitor.aliyun_cms.region=cn-hangzhou",
        f"monitor.aliyun_cms.endpoint={endpoint}", *overrides])
    exporter = AliyunCmsExporter(config)
    exporter.retry.sleep = lambda seconds: None
    return exporter, RunInfo(config, run_id="r-1", resumed=False)


def _records() -> list[dict]:
    """Five train records, one system record of a node with two GPUs, one cost record: 29 values."""
    train_records = [{"kind": "train", "step": step, "time": 1_800_000_000.0 + step + 0.25, "loss": 1.0 / step,
                      "samples_per_s": 100.0 + step, "mfu": 0.01 * step, "data_wait_s": 0.002, "step_time_s": 0.04}
                     for step in range(1, 6)]
    system = {"kind": "system", "time": 1_800_000_006.5, "node_rank": 1, "host": {"cpu_percent": 37.5},
              "gpus": [{"index": index, "utilization_percent": 90.0 + index, "memory_used_gib": 12.5,
                        "power_w": 250.0 + index} for index in range(2)]}
    cost = {"kind": "cost", "time": 1_800_000_007.0, "usd_spent": 0.125, "projected_usd_total": 2.5}
    return [*train_records, system, {"kind": "checkpoint", "time": 1.0, "step": 5}, cost]


def _metric_list(recorded: Recorded) -> list[dict[str, str]]:
    """The ``MetricList.N.Field`` query parameters of a recorded request, back as a list of dicts."""
    entries: dict[int, dict[str, str]] = {}
    for key, value in parse_qsl(urlsplit(recorded.path).query, keep_blank_values=True):
        match = re.fullmatch(r"MetricList\.(\d+)\.(\w+)", key)
        assert match, f"unexpected query parameter {key}"
        entries.setdefault(int(match[1]), {})[match[2]] = value
    assert sorted(entries) == list(range(1, len(entries) + 1))
    return [entries[index] for index in sorted(entries)]


def _expected_signature(recorded: Recorded, secret: str) -> str:
    """ACS3-HMAC-SHA256 over the request as the server received it (Alibaba Cloud's V3 signature)."""
    signed = re.search(r"SignedHeaders=([^,]+)", recorded.headers["authorization"])[1].split(";")
    split = urlsplit(recorded.path)
    query = sorted(parse_qsl(split.query, keep_blank_values=True))
    canonical_query = "&".join(f"{key}={quote(value, safe='~')}" for key, value in query)
    canonical_headers = "".join(f"{name}:{recorded.headers[name].strip()}\n" for name in signed)
    canonical = "\n".join([recorded.method, split.path or "/", canonical_query, canonical_headers, ";".join(signed),
                           hashlib.sha256(recorded.body).hexdigest()])
    to_sign = f"ACS3-HMAC-SHA256\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    return hmac.new(secret.encode(), to_sign.encode(), hashlib.sha256).hexdigest()


def _ms(seconds: float) -> str:
    return str(round(seconds * 1000))


def test_a_record_becomes_raw_values_with_json_dimensions_and_a_millisecond_time():
    record = {"kind": "train", "time": 1_800_000_000.25, "loss": 0.5, "samples_per_s": 100.0, "mfu": 0.25,
              "data_wait_s": 0.01, "step_time_s": 0.04}
    entries = {entry["MetricName"]: entry for entry in metric_list(record, {"Run": "r", "team": "vision"}, group_id=7)}
    assert {name: json.loads(entry["Values"]) for name, entry in entries.items()} == {
        "Loss": {"value": 0.5}, "SamplesPerSecond": {"value": 100.0}, "MFU": {"value": 25.0},
        "DataWaitShare": {"value": 25.0}}
    assert entries["Loss"] == {"GroupId": "7", "MetricName": "Loss", "Dimensions": '{"Run":"r","team":"vision"}',
                               "Time": "1800000000250", "Type": "0", "Values": '{"value":0.5}'}
    gpu = metric_list({"kind": "system", "time": 1.0, "node_rank": 1, "host": {"cpu_percent": 50.0},
                       "gpus": [{"index": 0, "utilization_percent": 90.0}]}, {"Run": "r"}, group_id=0)
    assert [(entry["MetricName"], json.loads(entry["Dimensions"])) for entry in gpu] == [
        ("CPUUtilization", {"Run": "r", "Node": "1"}), ("GPUUtilization", {"Run": "r", "Node": "1", "GPU": "0"})]
    assert metric_list({"kind": "train", "time": 1.0, "loss": float("nan")}, {}, group_id=0) == []  # JSON has no NaN
    assert metric_list({"kind": "checkpoint", "time": 1.0}, {}, group_id=0) == []


def test_the_sdk_sends_signed_batches_of_21_holding_the_records_values(cms_server, credentials, tmp_path, caplog,
                                                                       capsys):
    caplog.set_level(logging.DEBUG)
    exporter, run = _exporter(tmp_path, cms_server.endpoint, "monitor.aliyun_cms.group_id=4242",
                              "monitor.aliyun_cms.dimensions={team: vision}")
    exporter.open(run)
    exporter.export(_records())
    exporter.close()

    assert [len(_metric_list(recorded)) for recorded in cms_server.requests] == [21, 8]
    assert exporter.sent == 29
    for recorded in cms_server.requests:
        assert (recorded.method, urlsplit(recorded.path).path) == ("POST", "/")
        assert recorded.headers["x-acs-action"] == "PutCustomMetric"
        assert recorded.headers["x-acs-version"] == "2019-01-01"
        authorization = recorded.headers["authorization"]
        assert authorization.startswith(f"ACS3-HMAC-SHA256 Credential={KEY_ID},SignedHeaders=")
        signature = re.search(r"Signature=([0-9a-f]{64})$", authorization)[1]
        assert signature == _expected_signature(recorded, SECRET)
        assert SECRET not in json.dumps(recorded.headers) + recorded.path + recorded.body.decode()

    sent = [entry for recorded in cms_server.requests for entry in _metric_list(recorded)]
    assert {(entry["GroupId"], entry["Type"]) for entry in sent} == {("4242", "0")}
    by_key = {(entry["MetricName"], entry["Time"], entry["Dimensions"]): json.loads(entry["Values"])["value"]
              for entry in sent}
    assert len(by_key) == 29
    run_dims = {"Run": "cms-run", "team": "vision"}
    for record in _records():
        dims = json.dumps(run_dims, separators=(",", ":"))
        if record["kind"] == "train":
            assert by_key[("Loss", _ms(record["time"]), dims)] == record["loss"]
            assert by_key[("SamplesPerSecond", _ms(record["time"]), dims)] == record["samples_per_s"]
            assert by_key[("MFU", _ms(record["time"]), dims)] == pytest.approx(100 * record["mfu"], rel=1e-15)
            assert by_key[("DataWaitShare", _ms(record["time"]), dims)] == pytest.approx(5.0, rel=1e-12)
        elif record["kind"] == "system":
            node = json.dumps({**run_dims, "Node": "1"}, separators=(",", ":"))
            assert by_key[("CPUUtilization", _ms(record["time"]), node)] == record["host"]["cpu_percent"]
            for gpu in record["gpus"]:
                per_gpu = json.dumps({**run_dims, "Node": "1", "GPU": str(gpu["index"])}, separators=(",", ":"))
                assert by_key[("GPUUtilization", _ms(record["time"]), per_gpu)] == gpu["utilization_percent"]
                assert by_key[("GPUMemoryUsed", _ms(record["time"]), per_gpu)] == gpu["memory_used_gib"]
                assert by_key[("GPUPower", _ms(record["time"]), per_gpu)] == gpu["power_w"]
        elif record["kind"] == "cost":
            assert by_key[("USDSpent", _ms(record["time"]), dims)] == record["usd_spent"]
            assert by_key[("USDProjected", _ms(record["time"]), dims)] == record["projected_usd_total"]
    logged = caplog.text + "".join(capsys.readouterr())
    assert SECRET not in logged and KEY_ID not in logged


def test_throttling_and_server_errors_are_retried_until_the_batch_is_taken(cms_server, credentials, tmp_path, caplog):
    cms_server.script.extend([
        (400, {"Code": "Throttling.User", "Message": "Request was denied due to user flow control.", "RequestId": "a"}),
        (503, {"Code": "ServiceUnavailable", "Message": "busy", "RequestId": "b"}),
    ])
    exporter, run = _exporter(tmp_path, cms_server.endpoint)
    exporter.open(run)
    exporter.export(_records()[:1])
    assert len(cms_server.requests) == 3
    assert _metric_list(cms_server.requests[0]) == _metric_list(cms_server.requests[2])  # the same batch again
    assert exporter.sent == 4 and len(exporter.retry.attempts_log) == 2
    assert "Throttling.User" in caplog.text and "ServiceUnavailable" in caplog.text
    assert SECRET not in caplog.text and KEY_ID not in caplog.text


@pytest.mark.parametrize("answer", [
    (403, {"Code": "InvalidAccessKeyId.NotFound", "Message": "Specified access key is not found.", "RequestId": "c"}),
    (200, {"Code": "206", "Message": "some metrics were refused", "RequestId": "d"}),
], ids=["refused", "partly-refused"])
def test_a_refused_batch_is_not_retried(cms_server, credentials, tmp_path, answer):
    cms_server.script.append(answer)
    exporter, run = _exporter(tmp_path, cms_server.endpoint)
    exporter.open(run)
    with pytest.raises(CloudMonitorError, match=answer[1]["Code"]) as error:
        exporter.export(_records()[:1])
    assert len(cms_server.requests) == 1
    assert SECRET not in str(error.value) and KEY_ID not in str(error.value)


def test_no_answer_is_retried_then_given_up_without_the_batch_in_the_message(credentials, tmp_path):
    from skylift.storage.errors import StorageTransientError

    exporter, run = _exporter(tmp_path, f"http://127.0.0.1:{free_port()}", "monitor.aliyun_cms.retry_deadline_s=0.5")
    exporter.open(run)
    exporter.retry.max_attempts = 3
    with pytest.raises(StorageTransientError, match="no answer") as error:
        exporter.export(_records()[:1])
    assert "failed after 3 attempts" in str(error.value)
    assert "MetricList" not in str(error.value) and SECRET not in str(error.value)


def test_without_credentials_the_chain_says_how_to_set_them(monkeypatch, tmp_path, cms_server):
    _alibaba_environment(monkeypatch, {"ALIBABA_CLOUD_ECS_METADATA_DISABLED": "true"})
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aliyun/config.json, no ~/.alibabacloud/credentials.ini
    from skylift.errors import SkyliftConfigError

    exporter, run = _exporter(tmp_path, cms_server.endpoint)
    with pytest.raises(SkyliftConfigError, match="no Alibaba Cloud credentials") as error:
        exporter.open(run)
    assert "ALIBABA_CLOUD_ACCESS_KEY_ID" in str(error.value) and "aliyun configure" in str(error.value)
    assert cms_server.requests == []


def test_a_region_or_an_endpoint_is_needed(credentials, monkeypatch, tmp_path):
    from skylift.config.load import load_config
    from skylift.errors import SkyliftConfigError

    config = load_config("examples/quickstart.yaml", [f"run_dir={tmp_path}", "monitor.exporters=[aliyun_cms]"])
    with pytest.raises(SkyliftConfigError, match="monitor.aliyun_cms.region"):
        AliyunCmsExporter(config).open(RunInfo(config, run_id="r-1", resumed=False))  # the hub warns; the run goes on
    monkeypatch.setenv("ALIBABA_CLOUD_REGION_ID", "cn-beijing")
    assert AliyunCmsExporter(config).region == "cn-beijing"


@pytest.mark.parametrize("dimensions, problem", [
    ("{Run: mine}", "set by skylift itself"),
    ("{team: 'a b'}", "CloudMonitor takes"),
    (f"{{team: {'x' * 65}}}", "CloudMonitor takes"),
])
def test_the_config_refuses_dimensions_cloudmonitor_would_not_take(dimensions, problem):
    from skylift.config.load import load_config
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match=problem):
        load_config("examples/quickstart.yaml", [f"monitor.aliyun_cms.dimensions={dimensions}"])


def test_a_missing_sdk_says_how_to_install_it(monkeypatch):
    import importlib.util

    from skylift.errors import SkyliftConfigError
    from skylift.train.services import _check_exporters

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "alibabacloud_cms20190101" else real_find_spec(name))
    with pytest.raises(SkyliftConfigError) as error:
        _check_exporters(["aliyun_cms"])
    assert "pip install 'skylift[aliyun-cms]'" in str(error.value)


def test_a_real_runs_losses_reach_cloudmonitor(cms_server, tmp_path):
    cms_server.script.extend([(503, {"Code": "ServiceUnavailable", "Message": "busy", "RequestId": "e"})] * 2)
    run_dir = tmp_path / "cms-real-run"
    result = train(run_dir, "monitor.exporters=[aliyun_cms]", "monitor.log_every_steps=5", "schedule.max_steps=30",
                   "monitor.aliyun_cms.region=cn-hangzhou", f"monitor.aliyun_cms.endpoint={cms_server.endpoint}",
                   "monitor.report=false",  # not exported to CloudMonitor, not read here (~1.5 s of matplotlib)
                   env=CREDENTIALS)
    assert result.returncode == 0, result.stderr[-3000:]
    train_records = records(run_dir, "train")
    assert [record["step"] for record in train_records] == list(range(1, 31))
    accepted = cms_server.requests[2:]  # the first two were answered 503 and sent again
    assert all(recorded.headers["x-acs-action"] == "PutCustomMetric" for recorded in cms_server.requests)
    losses = [(entry["Time"], json.loads(entry["Values"])["value"])
              for recorded in accepted for entry in _metric_list(recorded) if entry["MetricName"] == "Loss"]
    assert sorted(losses) == sorted((_ms(record["time"]), record["loss"]) for record in train_records)  # 30, exact
    assert {json.loads(entry["Dimensions"])["Run"] for recorded in accepted for entry in _metric_list(recorded)} == {
        "cms-real-run"}
    assert all(len(_metric_list(recorded)) <= 21 for recorded in cms_server.requests)
    assert SECRET not in result.stdout + result.stderr and KEY_ID not in result.stdout + result.stderr
    assert "exporter aliyun_cms" not in result.stderr  # retried, never failed

"""Exporters: a real run's figures in CloudWatch (moto on 127.0.0.1, through a fault proxy)."""

from __future__ import annotations

import datetime

import boto3
import pytest

from skylift.monitor.exporters.cloudwatch import metric_data
from tests.checkpoint.runs import records, train
from tests.servers import FaultyProxy

# No HTML report: it is not exported to CloudWatch and not read here (~1.5 s of matplotlib a run).
EXPORT = ("monitor.exporters=[cloudwatch]", "monitor.log_every_steps=5", "schedule.max_steps=30", "monitor.report=false")


def test_a_train_record_becomes_loss_throughput_mfu_and_data_wait_share():
    record = {"kind": "train", "time": 1_800_000_000.0, "loss": 0.5, "samples_per_s": 100.0, "mfu": 0.25,
              "data_wait_s": 0.01, "step_time_s": 0.04}
    data = {datum["MetricName"]: datum for datum in metric_data(record, [{"Name": "Run", "Value": "r"}],
                                                                  storage_resolution_s=60)}
    assert {name: datum["Value"] for name, datum in data.items()} == {
        "Loss": 0.5, "SamplesPerSecond": 100.0, "MFU": 25.0, "DataWaitShare": 25.0}
    assert data["MFU"]["Unit"] == "Percent" and data["Loss"]["Dimensions"] == [{"Name": "Run", "Value": "r"}]
    gpu = metric_data({"kind": "system", "time": 1.0, "node_rank": 1, "host": {"cpu_percent": 50.0},
                       "gpus": [{"index": 0, "utilization_percent": 90.0}]}, [], storage_resolution_s=1)
    assert [(d["MetricName"], d["Dimensions"]) for d in gpu] == [
        ("CPUUtilization", [{"Name": "Node", "Value": "1"}]),
        ("GPUUtilization", [{"Name": "Node", "Value": "1"}, {"Name": "GPU", "Value": "0"}])]
    assert metric_data({"kind": "checkpoint", "time": 1.0}, [], storage_resolution_s=60) == []


def _cloudwatch(endpoint: str):
    return boto3.session.Session().client("cloudwatch", region_name="us-east-1", endpoint_url=endpoint)


def _loss_statistics(client, namespace: str, train_records) -> tuple[int, float]:
    times = [record["time"] for record in train_records]
    result = client.get_metric_data(
        MetricDataQueries=[{"Id": f"s{stat.lower()}", "MetricStat": {"Metric": {
            "Namespace": namespace, "MetricName": "Loss", "Dimensions": [{"Name": "Run", "Value": namespace}]},
            "Period": 3600, "Stat": stat}} for stat in ("SampleCount", "Sum")],
        StartTime=datetime.datetime.fromtimestamp(min(times) - 60, tz=datetime.timezone.utc),
        EndTime=datetime.datetime.fromtimestamp(max(times) + 60, tz=datetime.timezone.utc),
    )
    values = {item["Id"]: sum(item["Values"]) for item in result["MetricDataResults"]}
    return int(values["ssamplecount"]), values["ssum"]


# The direct case in the fast lane; the throttled one (retries through a proxy) in the full lane.
@pytest.mark.parametrize("through_proxy", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["direct", "throttled"])
def test_a_real_runs_metrics_read_back_from_cloudwatch(moto_server, tmp_path, through_proxy):
    namespace = f"skylift-test-{'throttled' if through_proxy else 'direct'}"  # moto's metrics outlive a test
    endpoint, proxy = moto_server.endpoint_url, None
    if through_proxy:
        proxy = FaultyProxy(moto_server.port)
        proxy.fail(6, 503)  # throttling: the first PutMetricData calls are refused
        endpoint = proxy.endpoint_url
    try:
        run_dir = tmp_path / namespace  # the Run dimension too: moto's GetMetricData may not filter by namespace
        result = train(run_dir, *EXPORT, f"monitor.cloudwatch.namespace={namespace}",
                       env={"AWS_ENDPOINT_URL_CLOUDWATCH": endpoint})
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        if proxy is not None:
            proxy.close()
    if through_proxy:
        assert proxy.faults_injected == 6
    train_records = records(run_dir, "train")
    assert [record["step"] for record in train_records] == list(range(1, 31))  # no training step lost
    client = _cloudwatch(moto_server.endpoint_url)
    names = {metric["MetricName"] for metric in client.list_metrics(Namespace=namespace)["Metrics"]}
    assert {"Loss", "SamplesPerSecond", "DataWaitShare", "CPUUtilization"} <= names
    count, total = _loss_statistics(client, namespace, train_records)
    assert count == 30
    # Sums of 30 doubles in another order: a few units in the last place of the total.
    assert total == pytest.approx(sum(record["loss"] for record in train_records), rel=1e-12)
    assert "exporter cloudwatch" not in result.stderr or through_proxy  # direct: no failure warned


def test_an_exporter_whose_package_is_missing_says_how_to_install_it(monkeypatch):
    """Checked on every rank before any work (here with the vendor module made unfindable)."""
    import importlib.util

    from skylift.errors import SkyliftConfigError
    from skylift.train.services import _check_exporters

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real_find_spec(name))
    with pytest.raises(SkyliftConfigError) as error:
        _check_exporters(["cloudwatch", "wandb"])
    assert "monitor.exporters: wandb needs the package 'wandb'" in str(error.value)
    assert "pip install 'skylift[wandb]'" in str(error.value)

"""A script job's data, ``skylift submit --platform P --input NAME=URL -- python train.py``:
each platform's own mount in the real signed request a loopback server records
(SageMaker channel, DLC ``DataSources``, TI-ONE ``DataConfigs``, a Kubernetes volume,
SkyPilot ``file_mounts``), the folder in ``SKYLIFT_INPUT_<NAME>``, and a URL the
platform cannot mount refused in one line before anything is sent."""

from __future__ import annotations

import json

import pytest

from tests.submit.conftest import IMAGE
from tests.submit.fake_platforms import FakeTione
from tests.submit.recording import RecordingServer
from tests.submit.script_jobs import SCRIPT, SCRIPT_CONFIG, node_command
from tests.submit.test_cli_submit import PLATFORM_ARGS
from tests.submit.test_send_and_jobs import kube_api  # noqa: F401  (a fixture)

STORE = {"sagemaker": "s3", "pai": "oss", "tione": "cos-1250000000", "k8s": "pvc", "skypilot": "s3"}
FOLDERS = {"sagemaker": "/opt/ml/input/data", "pai": "/mnt/skylift/inputs", "tione": "/opt/ml/input/data",
           "k8s": "/mnt/skylift/inputs", "skypilot": "/mnt/skylift/inputs"}


def _url(platform: str, path: str) -> str:
    if platform == "tione":
        return f"cos://bucket-1250000000/{path}"
    if platform == "k8s":
        return f"pvc://datasets/{path}"
    return f"{STORE[platform]}://bucket/{path}"


def _argv(platform: str, *extra: str, inputs: tuple[str, ...] = ("train", "vocab")) -> list[str]:
    given = [part for name in inputs for part in ("--input", f"{name}={_url(platform, 'data/' + name)}")]
    return ["submit", "--platform", platform, "--image", IMAGE, "--count", "2", "--spot", "--json",
            *PLATFORM_ARGS[platform], "--config", SCRIPT_CONFIG, *given, *extra, "--", *SCRIPT]


@pytest.mark.parametrize("platform", list(PLATFORM_ARGS))
def test_the_job_learns_each_inputs_folder_and_the_dry_run_shows_them(platform, cli_here):
    result = cli_here(*_argv(platform, "--dry-run"))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    _, environment = node_command(platform, document["request"], document.get("applied_first", []))
    for name in ("train", "vocab"):
        folder = f"{FOLDERS[platform]}/{name}"
        assert environment[f"SKYLIFT_INPUT_{name.upper()}"] == folder
        assert f"input {name}: {_url(platform, 'data/' + name)} at {folder} (SKYLIFT_INPUT_{name.upper()})" in \
            document["notes"]
    text = cli_here(*[part for part in _argv(platform, "--dry-run") if part != "--json"])
    assert f"skylift submit --dry-run: input train: {_url(platform, 'data/train')} at {FOLDERS[platform]}/train" \
        in text.stdout


def test_sagemaker_sends_a_channel_per_input_in_the_signed_request(cli_here, vendor_credentials):
    from tests.submit.test_sagemaker import _input_shape, model_problems

    arn = "arn:aws:sagemaker:us-east-1:123456789012:training-job/x"
    server = RecordingServer(lambda request: (200, {"TrainingJobArn": arn}))
    try:
        result = cli_here(*_argv("sagemaker", "--set", f"submit.sagemaker.endpoint_url={server.endpoint}"))
        assert result.returncode == 0, result.stderr
        [recorded] = server.requests
    finally:
        server.close()
    assert recorded.headers["x-amz-target"] == "SageMaker.CreateTrainingJob"
    assert recorded.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=")
    body = recorded.json()
    assert body["InputDataConfig"] == [
        {"ChannelName": name, "InputMode": "FastFile", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": f"s3://bucket/data/{name}", "S3DataDistributionType": "FullyReplicated"}}}
        for name in ("train", "vocab")]
    # SageMaker mounts channel NAME at /opt/ml/input/data/NAME; SM_CHANNEL_NAME as its toolkit would set it.
    assert body["Environment"]["SM_CHANNEL_TRAIN"] == body["Environment"]["SKYLIFT_INPUT_TRAIN"] == \
        "/opt/ml/input/data/train"
    assert model_problems(_input_shape(), body) == []  # channel name pattern, enums, at most 20 channels


def test_pai_mounts_each_input_read_only_from_oss(cli_here, vendor_credentials):
    server = RecordingServer(lambda request: (200, {"JobId": "dlc1a2b3c4d", "RequestId": "req-1"}))
    try:
        assert cli_here(*_argv("pai", "--set", f"submit.pai.endpoint={server.endpoint}")).returncode == 0
        [recorded] = server.requests
    finally:
        server.close()
    assert recorded.headers["x-acs-action"] == "CreateJob" and "ACS3-HMAC-SHA256" in recorded.headers["authorization"]
    body = recorded.json()
    assert {"Uri": "oss://bucket/data/train/", "MountPath": "/mnt/skylift/inputs/train", "MountAccess": "RO"} in \
        body["DataSources"]
    assert body["Envs"]["SKYLIFT_INPUT_VOCAB"] == "/mnt/skylift/inputs/vocab"


def test_tione_maps_each_input_from_cos(cli_here, vendor_credentials):
    tione = FakeTione()
    try:
        assert cli_here(*_argv("tione", "--set", f"submit.tione.endpoint={tione.endpoint}")).returncode == 0
        [(action, body)] = tione.actions
    finally:
        tione.close()
    assert action == "CreateTrainingTask"
    assert {"MappingPath": "/opt/ml/input/data/train", "DataSourceType": "COS",
            "COSSource": {"Bucket": "bucket-1250000000", "Region": "ap-guangzhou", "Paths": ["data/train/"]}} in \
        body["DataConfigs"]
    assert {"Name": "SKYLIFT_INPUT_TRAIN", "Value": "/opt/ml/input/data/train", "IsPrivate": False} in body["Envs"]


def test_kubernetes_mounts_a_claim_and_a_host_folder_as_volumes(kube_api, cli_here):  # noqa: F811
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    from tests.submit.test_kubernetes import pydantic_unknown_keys

    server, _ = kube_api
    result = cli_here(*_argv("k8s", "--input", "cache=hostpath:///var/cache/hf", inputs=("train",)))
    assert result.returncode == 0, result.stderr
    body = server.requests[-1].json()
    assert body["kind"] == "TrainJob"
    [patch] = body["spec"]["runtimePatches"]
    [replicated] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "input-train", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
        {"name": "input-cache", "hostPath": {"path": "/var/cache/hf", "type": "Directory"}}]
    assert pod["containers"] == [{"name": "node", "volumeMounts": [
        {"name": "input-train", "mountPath": "/mnt/skylift/inputs/train", "readOnly": True, "subPath": "data/train"},
        {"name": "input-cache", "mountPath": "/mnt/skylift/inputs/cache", "readOnly": True}]}]
    TrainerV1alpha1TrainJob.from_dict(body)
    assert pydantic_unknown_keys(TrainerV1alpha1TrainJob, body) == []


def test_a_pytorch_job_mounts_the_inputs_in_its_pod_template():
    from skylift.submit import kubernetes
    from tests.submit.script_jobs import make_script_job
    from tests.submit.test_kubernetes_schemas import problems

    job = make_script_job("k8s", submit={"inputs": {"train": "pvc://datasets"},
                                         "kubernetes": {"api": "pytorchjob", "cloud": "eks"}})
    body = kubernetes.build(job).body
    for spec in body["spec"]["pytorchReplicaSpecs"].values():
        pod = spec["template"]["spec"]
        assert pod["volumes"] == [{"name": "input-train", "persistentVolumeClaim": {"claimName": "datasets",
                                                                                    "readOnly": True}}]
        assert pod["containers"][0]["volumeMounts"] == [
            {"name": "input-train", "mountPath": "/mnt/skylift/inputs/train", "readOnly": True}]
        assert problems("podtemplatespec-v1.json", spec["template"]) == []


def test_skypilot_mounts_each_bucket_with_file_mounts():
    from skylift.submit import skypilot
    from tests.submit.script_jobs import make_script_job
    from tests.submit.test_skypilot import _validate

    task = skypilot.build(make_script_job("skypilot", submit={"inputs": {"train": "gs://bucket/data"}})).body
    assert task["file_mounts"] == {"/mnt/skylift/inputs/train": {"source": "gs://bucket/data", "mode": "MOUNT"}}
    assert task["envs"]["SKYLIFT_INPUT_TRAIN"] == "/mnt/skylift/inputs/train"
    _validate(task)


@pytest.mark.parametrize(("platform", "url", "schemes"), [
    ("sagemaker", "gs://bucket/data", "SageMaker mounts only s3:// inputs"),
    ("pai", "s3://bucket/data", "PAI-DLC mounts only oss:// inputs"),
    ("tione", "oss://bucket/data", "TI-ONE mounts only cos:// inputs"),
    ("k8s", "s3://bucket/data", "Kubernetes mounts only pvc://CLAIM[/PATH] and hostpath:///PATH inputs, not s3"),
    ("skypilot", "oss://bucket/data", "SkyPilot mounts only s3://, gs://, r2:// inputs"),
])
def test_a_url_the_platform_cannot_mount_is_refused_in_one_line_and_nothing_is_sent(
        platform, url, schemes, cli_here, vendor_credentials, kube_api):  # noqa: F811
    server = RecordingServer(lambda request: (200, {"TrainingJobArn": "x", "JobId": "y"}))
    endpoint = {"sagemaker": ["--set", f"submit.sagemaker.endpoint_url={server.endpoint}"],
                "pai": ["--set", f"submit.pai.endpoint={server.endpoint}"],
                "tione": ["--set", f"submit.tione.endpoint={server.endpoint}"]}.get(platform, [])
    try:
        result = cli_here(*_argv(platform, "--input", f"extra={url}", *endpoint, inputs=()))
        sent = server.requests + kube_api[0].requests
    finally:
        server.close()
    assert result.returncode == 2 and sent == []
    [line] = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert line.startswith(f"  - --input extra: {schemes}")
    command = result.stderr.rstrip().splitlines()[-1]
    assert url not in command and "--input extra=" in command  # the fix replaces the URL, not beside it


def test_a_config_job_reads_data_url_not_inputs(cli_here):
    result = cli_here("submit", "examples/quickstart.yaml", "--platform", "k8s", "--image", IMAGE, "--dry-run",
                      *PLATFORM_ARGS["k8s"], "--input", "train=pvc://datasets")
    assert result.returncode == 2
    assert "--input train: a config job reads its data from data.url and data.val_url" in result.stderr


def test_a_bad_input_is_named(cli_here):
    result = cli_here(*_argv("k8s", "--dry-run", "--input", "2nd=pvc://x", inputs=()))
    assert result.returncode == 2 and "input name '2nd' must be a letter" in result.stderr
    result = cli_here(*_argv("k8s", "--dry-run", "--input", "train", inputs=()))
    assert result.returncode == 2 and "'train' is not NAME=URL" in result.stderr


def test_a_later_watch_resubmits_the_job_with_its_inputs(vendor_credentials, capsys, monkeypatch):
    """The job's record holds --input, so the resubmission after a reclaim mounts the same data."""
    from skylift.cli.main import main
    from tests.submit.fake_platforms import FakeDlc
    from tests.submit.script_jobs import REPO_ROOT
    from tests.submit.test_script_watch import _pai_argv

    monkeypatch.chdir(REPO_ROOT)
    dlc = FakeDlc(["reclaimed", "Succeeded"])
    try:
        assert main(_pai_argv(dlc, "--input", "train=oss://bucket/data/train")) == 0
        document = json.loads(capsys.readouterr().out)
        assert main(["jobs", "watch", document["job"]]) == 0
        first, second = dlc.created
    finally:
        dlc.close()
    assert second["DataSources"] == first["DataSources"]
    assert {"Uri": "oss://bucket/data/train/", "MountPath": "/mnt/skylift/inputs/train", "MountAccess": "RO"} in \
        second["DataSources"]
    assert second["Envs"]["SKYLIFT_INPUT_TRAIN"] == "/mnt/skylift/inputs/train"

"""``skylift submit`` for real and ``skylift jobs status|logs|stop`` on every platform,
against loopback servers (moto, SDK-facing fakes, a fake kube API, a fake ``sky``)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from skylift.cli.main import main
from tests.submit.conftest import IMAGE, SECRETS
from tests.submit.fake_platforms import FakeDlc, FakeTione
from tests.submit.recording import RecordingServer

BASE = ["submit", "examples/quickstart.yaml", "--image", IMAGE, "--count", "2", "--spot", "--json"]


def _submit_job(capsys, *platform_args: str) -> str:
    assert main([*BASE, *platform_args]) == 0
    return _submitted(capsys)["job"]


def _submitted(capsys) -> dict:
    output = capsys.readouterr()
    for secret in SECRETS:
        assert secret not in output.out + output.err
    return json.loads(output.out)


def test_sagemaker_submit_status_and_a_refused_stop(moto_server, vendor_credentials, monkeypatch, capsys):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # moto lacks StopTrainingJob: no retries of its 500
    endpoint = moto_server.endpoint_url
    argv = [*BASE, "--platform", "sagemaker", "--instance", "ml.p3.16xlarge", "--region", "us-east-1",
            "--set", "checkpoint.root=s3://bucket/ckpt", "--set", f"submit.sagemaker.endpoint_url={endpoint}",
            "--set", "submit.sagemaker.role_arn=arn:aws:iam::123456789012:role/SkyliftTraining"]
    assert main(argv) == 0
    document = _submitted(capsys)
    assert document["sent"] is True and document["job"].startswith("sagemaker:us-east-1:skylift-quickstart-")
    assert main(["jobs", "status", document["job"], "--endpoint", endpoint, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "succeeded"  # moto completes jobs at once
    assert main(["jobs", "stop", document["job"], "--endpoint", endpoint]) == 1
    error = capsys.readouterr().err
    assert error.startswith("skylift jobs: AWS SageMaker:") and "Traceback" not in error


def test_sagemaker_logs_read_each_hosts_cloudwatch_stream(moto_server, vendor_credentials, monkeypatch, capsys):
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS", moto_server.endpoint_url)
    job = "sagemaker:us-east-1:skylift-logs-20261201-080000"
    assert main(["jobs", "logs", job]) == 0  # no log group yet: nothing to show
    assert capsys.readouterr().out == ""
    logs = boto3.client("logs", region_name="us-east-1", endpoint_url=moto_server.endpoint_url)
    logs.create_log_group(logGroupName="/aws/sagemaker/TrainingJobs")
    stream = "skylift-logs-20261201-080000/algo-1-1764576000"
    logs.create_log_stream(logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=stream)
    logs.put_log_events(logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=stream,
                        logEvents=[{"timestamp": int(time.time() * 1000), "message": "step 3 loss 1.90"}])
    assert main(["jobs", "logs", job]) == 0
    assert capsys.readouterr().out == "[algo-1-1764576000] step 3 loss 1.90\n"


def test_pai_submit_then_status_logs_and_stop(vendor_credentials, capsys):
    dlc = FakeDlc(["Succeeded"])
    try:
        job = _submit_job(capsys, "--platform", "pai", "--instance", "ecs.gn7i-c8g1.2xlarge", "--region", "cn-hangzhou",
                          "--set", "checkpoint.root=oss://bucket/ckpt", "--set", f"submit.pai.endpoint={dlc.endpoint}")
        assert job == "pai:cn-hangzhou:dlc0001"
        assert dlc.created[0]["JobSpecs"][0]["UseSpotInstance"] is True
        assert main(["jobs", "status", job, "--endpoint", dlc.endpoint]) == 0
        assert "running" in capsys.readouterr().out
        assert main(["jobs", "logs", job, "--endpoint", dlc.endpoint]) == 0
        assert "[dlc0001-worker-0] step 2 loss 2.10" in capsys.readouterr().out
        assert main(["jobs", "stop", job, "--endpoint", dlc.endpoint]) == 0
        assert dlc.stopped == ["dlc0001"]
    finally:
        dlc.close()


def test_tione_submit_then_status_logs_and_stop(vendor_credentials, capsys):
    tione = FakeTione()
    try:
        job = _submit_job(capsys, "--platform", "tione", "--instance", "TI.GN7.2XLARGE32.POST",
                          "--region", "ap-guangzhou", "--set", "checkpoint.root=cos://bucket-1250000000/ckpt",
                          "--set", f"submit.tione.endpoint={tione.endpoint}",
                          "--set", "submit.tione.cos_keys_from=image")
        assert job == "tione:ap-guangzhou:train-51234"
        for action in ("status", "logs", "stop"):
            assert main(["jobs", action, job, "--endpoint", tione.endpoint]) == 0
        output = capsys.readouterr().out
        assert "running" in output and "step 1 loss 2.30" in output
        assert [action for action, _ in tione.actions] == [
            "CreateTrainingTask", "DescribeTrainingTask", "DescribeLogs", "StopTrainingTask"]
        assert tione.actions[3][1] == {"Id": "train-51234"}
    finally:
        tione.close()


@pytest.fixture
def kube_api(tmp_path, monkeypatch):
    """A fake kube API server on loopback and a kubeconfig whose current context is it."""
    objects: dict[str, dict] = {}

    def answer(request):
        path = request.path.split("?")[0]
        if request.method == "POST" and path.endswith("/pytorchjobs") and refused_kinds.get("PyTorchJob"):
            return 422, {"kind": "Status", "code": 422, "message": refused_kinds["PyTorchJob"]}
        if request.method == "POST":
            body = request.json()
            name = body["metadata"]["name"]
            created = {**body, "metadata": {**body["metadata"], "uid": f"uid-{name}"}}  # as the API server answers
            objects[path + "/" + name] = created
            return 201, created
        if request.method == "PATCH" and refused_kinds.get("Secret ownership"):
            refusal = refused_kinds["Secret ownership"]
            return 403, {"kind": "Status", "code": 403, "reason": "Forbidden", "message": refusal}
        if request.method == "PATCH" and path in objects:
            patch = request.json()
            objects[path]["metadata"].update(patch["metadata"])  # enough of a strategic merge for metadata
            return 200, objects[path]
        if request.path.startswith("/api/v1/namespaces/default/pods/") and request.path.split("?")[0].endswith("/log"):
            return 200, "step 3 loss 1.90\n"
        if request.path.startswith("/api/v1/namespaces/default/pods"):
            return 200, {"kind": "PodList", "apiVersion": "v1", "items": [{"metadata": {"name": "job-node-0-0"}}]}
        if request.method == "GET" and request.path.split("?")[0] in objects:
            body = objects[request.path.split("?")[0]]
            return 200, {**body, "status": {"conditions": [{"type": "Complete", "status": "True", "message": "done"}]}}
        if request.method == "DELETE" and "/secrets/" in path and refused_kinds.get("Secret deletion"):
            return 403, {"kind": "Status", "code": 403, "reason": "Forbidden", "message": "cannot delete secrets"}
        if request.method == "DELETE":
            return 200, {"kind": "Status", "status": "Success"}
        return 404, {"kind": "Status", "code": 404, "message": "not found"}

    refused_kinds: dict[str, str] = {}  # kind (or "Secret ownership") -> the API server's refusal
    server = RecordingServer(answer)
    server.refused_kinds = refused_kinds
    config = tmp_path / "kubeconfig"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "loopback",
        "clusters": [{"name": "loopback", "cluster": {"server": server.endpoint}}],
        "contexts": [{"name": "loopback", "context": {"cluster": "loopback", "user": "tester"}}],
        "users": [{"name": "tester", "user": {"token": SECRETS[1]}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(config))
    yield server, objects
    server.close()


def test_kubernetes_submit_creates_the_runtime_then_the_train_job(kube_api, capsys):
    server, objects = kube_api
    argv = [*BASE, "--platform", "k8s", "--instance", "p4d.24xlarge", "--gpus-per-node", "8",
            "--set", "checkpoint.root=s3://bucket/ckpt", "--set", "submit.kubernetes.cloud=eks"]
    assert main(argv) == 0
    document = _submitted(capsys)
    paths = [request.path for request in server.requests]
    assert paths == ["/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes",
                     "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs"]
    assert server.requests[1].json() == document["request"]
    assert server.requests[0].headers["authorization"] == f"Bearer {SECRETS[1]}"
    job = document["job"]
    assert job.startswith("k8s:default/trainjobs:skylift-quickstart-")
    assert main(["jobs", "status", job]) == 0
    assert "succeeded" in capsys.readouterr().out
    assert main(["jobs", "logs", job]) == 0
    assert "[job-node-0-0] step 3 loss 1.90" in capsys.readouterr().out
    assert "labelSelector=jobset.sigs.k8s.io%2Fjobset-name%3D" in server.requests[-2].path
    assert main(["jobs", "stop", job]) == 0
    assert server.requests[-1].method == "DELETE"


def test_kubernetes_submit_puts_envs_in_a_secret_owned_by_the_job(kube_api, capsys):
    server, objects = kube_api
    argv = [*BASE, "--platform", "k8s", "--set", "checkpoint.root=s3://bucket/ckpt",
            "--set", "submit.kubernetes.cloud=eks", "--set", f"submit.envs.HF_TOKEN={SECRETS[0]}",
            "--set", "submit.envs.NOTE=pw1"]
    assert main(argv) == 0
    output = capsys.readouterr()
    assert "pw1" not in output.out + output.err and output.err == ""
    name = json.loads(output.out)["job"].rsplit(":", 1)[1]
    assert [(request.method, request.path) for request in server.requests] == [
        ("POST", "/api/v1/namespaces/default/secrets"),
        ("POST", "/apis/trainer.kubeflow.org/v1alpha1/clustertrainingruntimes"),
        ("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/default/trainjobs"),
        ("PATCH", f"/api/v1/namespaces/default/secrets/{name}-envs")]
    secret, _, job, owner = (request.json() for request in server.requests)
    assert secret["stringData"] == {"HF_TOKEN": SECRETS[0], "NOTE": "pw1"}  # the values go to the cluster
    assert (secret["kind"], secret["type"], secret["metadata"]["name"]) == ("Secret", "Opaque", f"{name}-envs")
    sent = json.dumps(job)
    assert SECRETS[0] not in sent and "pw1" not in sent
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": f"{name}-envs", "key": "HF_TOKEN"}}} in \
        job["spec"]["trainer"]["env"]
    assert owner == {"metadata": {"ownerReferences": [
        {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": name, "uid": f"uid-{name}"}]}}
    assert server.requests[3].headers["content-type"] == "application/strategic-merge-patch+json"
    assert objects[f"/api/v1/namespaces/default/secrets/{name}-envs"]["metadata"]["ownerReferences"][0]["uid"] == \
        f"uid-{name}"


def test_kubernetes_a_secret_that_cannot_be_owned_is_said_and_the_job_still_runs(kube_api, capsys):
    server, _ = kube_api
    server.refused_kinds["Secret ownership"] = 'cannot patch resource "secrets"'
    argv = [*BASE, "--platform", "k8s", "--set", "checkpoint.root=s3://bucket/ckpt",
            "--set", "submit.kubernetes.cloud=eks", "--set", f"submit.envs.HF_TOKEN={SECRETS[0]}"]
    assert main(argv) == 0
    output = capsys.readouterr()
    name = json.loads(output.out)["job"].rsplit(":", 1)[1]
    assert output.err.startswith(f"skylift submit: the Secret {name}-envs holding submit.envs could not be made "
                                 f"owned by job {name} (403 Forbidden)")
    assert output.err.rstrip().endswith(f"kubectl delete secret {name}-envs -n default")
    assert SECRETS[0] not in output.out + output.err


@pytest.mark.parametrize("deletion_refused", [False, True], ids=["deleted", "deletion-refused"])
def test_kubernetes_a_refused_job_takes_its_secret_back(kube_api, capsys, deletion_refused):
    server, _ = kube_api
    server.refused_kinds["PyTorchJob"] = "admission webhook denied the request"
    if deletion_refused:
        server.refused_kinds["Secret deletion"] = "yes"
    argv = [*BASE, "--platform", "k8s", "--set", "checkpoint.root=s3://bucket/ckpt",
            "--set", "submit.kubernetes.cloud=gke", "--set", "submit.kubernetes.api=pytorchjob",
            "--set", f"submit.envs.HF_TOKEN={SECRETS[0]}"]
    assert main(argv) == 1
    error = capsys.readouterr().err
    assert "admission webhook denied the request" in error and SECRETS[0] not in error
    calls = [(request.method, request.path.split("?")[0]) for request in server.requests]
    assert calls[0] == ("POST", "/api/v1/namespaces/default/secrets")
    assert calls[1] == ("POST", "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs")
    assert calls[2][0] == "DELETE" and calls[2][1].startswith("/api/v1/namespaces/default/secrets/skylift-quickstart-")
    assert len(calls) == 3
    secret = calls[2][1].rsplit("/", 1)[1]
    left = (f"the job was refused and its Secret {secret} could not be deleted (403); delete it with: "
            f"kubectl delete secret {secret} -n default")
    assert (left in error) is deletion_refused


def test_skypilot_submit_runs_sky_jobs_launch_with_the_task(tmp_path, monkeypatch, capsys):
    log = tmp_path / "sky.log"
    sky = tmp_path / "bin" / "sky"
    sky.parent.mkdir()
    sky.write_text(f"""#!{sys.executable}
import json, sys
from pathlib import Path
args = sys.argv[1:]
task = Path(args[-1]).read_text() if args[:2] == ["jobs", "launch"] else None
with open({str(log)!r}, "a") as log:
    log.write(json.dumps({{"args": args, "task": task}}) + "\\n")
if args[:2] == ["jobs", "queue"]:
    launched = json.loads(open({str(log)!r}).readline())["args"]
    name = launched[launched.index("--name") + 1]
    print("ID  TASK  NAME  RESOURCES  SUBMITTED  TOT. DURATION  JOB DURATION  #RECOVERIES  STATUS")
    print(f"7   -     {{name}}  2x[A100:8]  1 min ago  1m  30s  1  RECOVERING")
if args[:2] == ["jobs", "logs"]:
    print("(head, rank=0) step 3 loss 1.90")
""")
    sky.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sky.parent}:{__import__('os').environ['PATH']}")
    argv = [*BASE, "--platform", "skypilot", "--instance", "A100:8", "--set", "checkpoint.root=s3://bucket/ckpt",
            "--set", "submit.name=skylift-x"]
    assert main(argv) == 0
    job = _submitted(capsys)["job"]
    [launch] = [json.loads(line) for line in log.read_text().splitlines()]  # one call so far
    assert launch["args"][5] == job.rsplit(":", 1)[1]
    assert launch["args"][:5] == ["jobs", "launch", "--yes", "--detach-run", "--name"]
    assert "use_spot: true" in launch["task"] and "num_nodes: 2" in launch["task"]
    assert main(["jobs", "status", job]) == 0
    assert "running - RECOVERING" in capsys.readouterr().out
    assert main(["jobs", "logs", job]) == 0
    assert "(head, rank=0) step 3 loss 1.90" in capsys.readouterr().out
    assert main(["jobs", "stop", job]) == 0
    calls = [json.loads(line)["args"] for line in log.read_text().splitlines()]
    name = job.rsplit(":", 1)[1]
    assert calls[-2:] == [["jobs", "logs", "--no-follow", "--name", name], ["jobs", "cancel", "--yes", "--name", name]]


def test_kubernetes_pytorch_job_goes_to_the_training_operator(kube_api, capsys):
    server, _ = kube_api
    argv = [*BASE, "--platform", "k8s", "--set", "checkpoint.root=s3://bucket/ckpt",
            "--set", "submit.kubernetes.cloud=gke", "--set", "submit.kubernetes.api=pytorchjob"]
    assert main(argv) == 0
    job = _submitted(capsys)["job"]
    [create] = server.requests
    assert create.path == "/apis/kubeflow.org/v1/namespaces/default/pytorchjobs"
    assert create.json()["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert job.startswith("k8s:default/pytorchjobs:")
    assert main(["jobs", "status", job]) == 0
    assert "succeeded" in capsys.readouterr().out

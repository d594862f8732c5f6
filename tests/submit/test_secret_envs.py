"""Secrets among ``submit.envs``: a secret-looking name with a literal value is refused
where the request would carry it in clear text (SageMaker, PAI-DLC, TI-ONE), in one
line with the platform's fix and before anything is sent; on Kubernetes
``secret:NAME/KEY`` lands as ``valueFrom.secretKeyRef`` to that Secret."""

from __future__ import annotations

import json

import pytest

from tests.submit.conftest import IMAGE, SECRETS
from tests.submit.recording import RecordingServer
from tests.submit.script_jobs import SCRIPT, SCRIPT_CONFIG
from tests.submit.test_cli_submit import PLATFORM_ARGS
from tests.submit.test_send_and_jobs import kube_api  # noqa: F401  (a fixture)

FIXES = {
    "sagemaker": "SageMaker's Environment has no secret reference: drop it, give the job's IAM role",
    "pai": "PAI-DLC's Envs has no secret reference: drop it and read the secret inside the job",
    "tione": "TI-ONE's Envs has no secret reference (IsPrivate only hides a value that the request still carries)",
}
ENDPOINT_KEYS = {"sagemaker": "submit.sagemaker.endpoint_url", "pai": "submit.pai.endpoint",
                 "tione": "submit.tione.endpoint"}


def _config_job(platform: str, *extra: str) -> list[str]:
    return ["submit", "examples/quickstart.yaml", "--platform", platform, "--image", IMAGE, "--count", "2", "--json",
            *PLATFORM_ARGS[platform], *extra]


def _script_job(platform: str, *extra: str) -> list[str]:
    return ["submit", "--platform", platform, "--image", IMAGE, "--count", "2", "--json", *PLATFORM_ARGS[platform],
            "--config", SCRIPT_CONFIG, *extra, "--", *SCRIPT]


@pytest.mark.parametrize("job", [_config_job, _script_job], ids=["config-job", "script-job"])
@pytest.mark.parametrize("platform", list(FIXES))
def test_a_literal_secret_is_refused_in_one_line_and_nothing_is_sent(platform, job, cli_here, vendor_credentials):
    server = RecordingServer(lambda request: (200, {"TrainingJobArn": "x", "JobId": "y", "Response": {"Id": "z"}}))
    try:
        result = cli_here(*job(platform, "--set", f"{ENDPOINT_KEYS[platform]}={server.endpoint}",
                               "--set", f"submit.envs.HF_TOKEN={SECRETS[0]}", "--set", "submit.envs.STEPS=3"))
        assert result.returncode == 2 and server.requests == []
    finally:
        server.close()
    [line] = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert line.startswith("  - submit.envs.HF_TOKEN: looks like a secret and ") and FIXES[platform] in line
    assert SECRETS[0] not in result.stderr
    command = result.stderr.rstrip().splitlines()[-1]
    assert "HF_TOKEN" not in command and "submit.envs.STEPS=3" in command  # the command that passes drops it


@pytest.mark.parametrize("platform", ["sagemaker", "pai", "tione", "skypilot"])
def test_a_secret_reference_is_refused_where_nothing_resolves_it(platform, cli_here):
    result = cli_here(*_config_job(platform, "--dry-run", "--set", "submit.envs.HF_TOKEN=secret:hf/token"))
    assert result.returncode == 2
    assert "submit.envs.HF_TOKEN: is a secret: reference, which" in result.stderr
    assert "cannot resolve (only Kubernetes has Secrets)" in result.stderr


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_a_secret_reference_lands_as_a_secret_key_ref_and_no_secret_is_made(api, kube_api, cli_here):  # noqa: F811
    server, _ = kube_api
    result = cli_here(*_script_job("k8s", "--set", f"submit.kubernetes.api={api}",
                                   "--set", "submit.envs.HF_TOKEN=secret:hf-credentials/token"))
    assert result.returncode == 0, result.stderr
    assert not any("/secrets" in request.path for request in server.requests)  # nothing of ours holds it
    body = server.requests[-1].json()
    if api == "trainjob":
        env = body["spec"]["trainer"]["env"]
    else:
        env = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}} in env


def test_a_reference_and_a_literal_together_on_kubernetes(kube_api, cli_here):  # noqa: F811
    """The literal goes in the job's own Secret (by reference too); the reference stays out of it."""
    server, objects = kube_api
    result = cli_here(*_config_job("k8s", "--set", "submit.envs.HF_TOKEN=secret:hf-credentials/token",
                                   "--set", f"submit.envs.WANDB_API_KEY={SECRETS[2]}"))
    assert result.returncode == 0, result.stderr
    [secret] = [request.json() for request in server.requests if request.path.endswith("/secrets")]
    assert secret["stringData"] == {"WANDB_API_KEY": SECRETS[2]}
    [job] = [request.json() for request in server.requests if request.path.endswith("/trainjobs")]
    env = job["spec"]["trainer"]["env"]
    name = secret["metadata"]["name"]
    assert {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": name, "key": "WANDB_API_KEY"}}} in env
    assert SECRETS[2] not in result.stdout + result.stderr


def test_a_malformed_reference_is_refused(cli_here):
    result = cli_here(*_config_job("k8s", "--dry-run", "--set", "submit.envs.HF_TOKEN=secret:Bad_Name"))
    assert result.returncode == 2
    assert "submit.envs.HF_TOKEN: is not secret:NAME/KEY" in result.stderr


def test_the_dry_run_shows_the_reference_and_no_value(cli_here):
    result = cli_here(*_script_job("k8s", "--dry-run", "--input", "train=pvc://datasets",
                                   "--set", "submit.envs.HF_TOKEN=secret:hf-credentials/token",
                                   "--set", f"submit.envs.NOTE={SECRETS[1]}"))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert "input train: pvc://datasets at /mnt/skylift/inputs/train (SKYLIFT_INPUT_TRAIN)" in document["notes"]
    env = document["request"]["spec"]["trainer"]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-credentials", "key": "token"}}} in env
    assert SECRETS[1] not in result.stdout


def test_pods_get_no_storage_credentials_of_this_machine(vendor_credentials):
    """The pods reach the checkpoint bucket with their service account (IRSA, workload
    identity): no key of the submitting machine is written into any object sent."""
    from skylift.submit import kubernetes
    from tests.submit.conftest import make_job

    for api in ("trainjob", "pytorchjob"):
        request = kubernetes.build(make_job("k8s", submit={"kubernetes": {"api": api, "cloud": "eks"}}))
        sent = json.dumps([*request.extra, request.body])
        for name, value in vendor_credentials.items():
            if "KEY" in name or "SECRET" in name or "TOKEN" in name:
                assert name not in sent and value not in sent, (api, name)

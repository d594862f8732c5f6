"""``submit.envs`` on Kubernetes travel by reference: a ``Secret`` holds the values and
the job's containers read them through ``valueFrom.secretKeyRef``, so the job manifest
(readable by anyone who may read the job) holds none. Checked against the Kubernetes
OpenAPI (``kubernetes-validate``) and the Kubeflow API models."""

from __future__ import annotations

import json

import pytest

from skylift.cli.main import main
from skylift.errors import SkyliftConfigError
from skylift.submit import kubernetes
from tests.submit.conftest import make_job
from tests.submit.test_cli_submit import _argv
from tests.submit.test_kubernetes import openapi_problems, pydantic_unknown_keys

ENVS = {"HF_TOKEN": "hf-sentinel-value-0001", "NOTE": "pw1"}  # a short one too: hidden whatever its length


def _request(api: str = "trainjob", envs: dict[str, str] | None = None):
    return kubernetes.build(make_job("k8s", submit={"kubernetes": {"api": api, "cloud": "eks"},
                                                    "envs": ENVS if envs is None else envs}))


def _containers_env(request) -> list[dict]:
    body = request.body
    if body["kind"] == "TrainJob":
        return body["spec"]["trainer"]["env"]
    [env] = {json.dumps(spec["template"]["spec"]["containers"][0]["env"])
             for spec in body["spec"]["pytorchReplicaSpecs"].values()}
    return json.loads(env)


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_the_jobs_env_references_a_secret_that_holds_the_values(api):
    request = _request(api)
    manifest = json.dumps(request.body)
    for value in ENVS.values():
        assert value not in manifest
    env = {entry["name"]: entry for entry in _containers_env(request)}
    assert env["SKYLIFT_PLATFORM"] == {"name": "SKYLIFT_PLATFORM", "value": "k8s"}
    secret_name = f"{request.body['metadata']['name']}-envs"
    for name in ENVS:
        assert env[name] == {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": name}}}
    [secret] = [item for item in request.extra if item["kind"] == "Secret"]
    assert request.extra[0] is secret  # created before anything else
    assert secret["metadata"] == {"name": secret_name, "namespace": "default", "labels": {
        "app.kubernetes.io/managed-by": "skylift", "skylift.io/job": request.body["metadata"]["name"]}}
    assert (secret["type"], secret["stringData"]) == ("Opaque", ENVS)


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_the_secret_and_the_references_match_kubernetes_and_the_kubeflow_models(api):
    pytest.importorskip("kubernetes_validate")
    from tests.submit.test_kubernetes_schemas import problems

    request = _request(api)
    [secret] = [item for item in request.extra if item["kind"] == "Secret"]
    assert problems("secret-v1.json", secret) == []
    for entry in _containers_env(request):
        assert problems("envvar-v1.json", entry) == []
    if api == "trainjob":
        from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

        trainer = TrainerV1alpha1TrainJob.from_dict(request.body).spec.trainer
        assert trainer.env[1].value_from.secret_key_ref.key == "HF_TOKEN"
        assert pydantic_unknown_keys(TrainerV1alpha1TrainJob, request.body) == []
    else:
        assert openapi_problems("KubeflowOrgV1PyTorchJob", request.body) == []
        for spec in request.body["spec"]["pytorchReplicaSpecs"].values():
            assert problems("podtemplatespec-v1.json", spec["template"]) == []


def test_a_job_without_envs_has_no_secret():
    request = _request(envs={})
    assert [item["kind"] for item in request.extra] == ["ClusterTrainingRuntime"]
    assert request.body["spec"]["trainer"]["env"] == [{"name": "SKYLIFT_PLATFORM", "value": "k8s"}]


def test_an_env_name_a_secret_cannot_hold_is_refused_by_name():
    with pytest.raises(SkyliftConfigError, match=r"submit\.envs\.MY VAR: a Kubernetes Secret key"):
        _request(envs={"MY VAR": "x"})


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_the_dry_run_shows_the_references_and_the_secret_redacted(as_json, capsys, vendor_credentials):
    argv = _argv("k8s", *[part for name, value in ENVS.items() for part in ("--set", f"submit.envs.{name}={value}")],
                 *(["--json"] if as_json else []))
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for value in ENVS.values():
        assert value not in printed
    assert "secretKeyRef" in printed and ("kind: Secret" in printed or '"kind": "Secret"' in printed)
    if as_json:
        [secret] = [item for item in json.loads(printed)["applied_first"] if item["kind"] == "Secret"]
        assert secret["stringData"] == {"HF_TOKEN": "***redacted***", "NOTE": "***redacted***"}

"""The Kubernetes objects inside our manifests against the Kubernetes OpenAPI, as JSON
schemas with unknown fields refused ("local-strict"), shipped by the PyPI package
``kubernetes-validate`` (a test dependency).

No PyPI package ships the Kubeflow Trainer, JobSet or v1 PyTorchJob CRDs (checked:
``kubeflow-trainer-api``, ``kubeflow-training``, ``kubeflow`` wheels and sdists), so
the CRD-level fields stay with the model walks of ``test_kubernetes.py``; what the CRDs
embed from Kubernetes itself (the JobSet's batch/v1 ``JobTemplateSpec`` with its
``podFailurePolicy``, the PyTorchJob's ``PodTemplateSpec``, the TrainJob's ``env`` and
``resourcesPerNode``) is checked here against the real schemas.
"""

from __future__ import annotations

import copy
import json
from importlib import resources

import pytest

from skylift.submit import kubernetes
from tests.submit.conftest import make_job

kubernetes_validate = pytest.importorskip("kubernetes_validate")


def _schema_folder():
    # The newest Kubernetes release the package ships, strict variant.
    folders = [item for item in (resources.files(kubernetes_validate) / "kubernetes-json-schema").iterdir()
               if item.name.endswith("-local-strict")]
    return max(folders, key=lambda item: tuple(int(part) for part in item.name[1:].split("-")[0].split(".")))


def problems(schema_name: str, value: object) -> list[str]:
    import jsonschema
    import referencing
    import referencing.jsonschema

    folder = _schema_folder()
    definitions = json.loads((folder / "_definitions.json").read_text())
    registry = referencing.Registry().with_resource(
        "/api/_definitions.json",
        referencing.Resource.from_contents(definitions, default_specification=referencing.jsonschema.DRAFT202012))
    validator = jsonschema.Draft202012Validator(json.loads((folder / schema_name).read_text()), registry=registry)
    return sorted(f"/{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(value))


@pytest.mark.parametrize("cloud", ["eks", "gke", "aks", "ack", "tke"])
def test_the_runtimes_job_template_and_the_trainers_env_and_resources_match_kubernetes(cloud):
    request = kubernetes.build(make_job("k8s", submit={"kubernetes": {"cloud": cloud}}))
    [runtime] = request.extra
    [replicated_job] = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert problems("jobtemplatespec-batch-v1.json", replicated_job["template"]) == []
    trainer = request.body["spec"]["trainer"]
    for env in trainer["env"]:
        assert problems("envvar-v1.json", env) == []
    assert problems("resourcerequirements-v1.json", trainer["resourcesPerNode"]) == []


def test_the_pytorch_jobs_pod_templates_match_kubernetes():
    body = kubernetes.build(make_job("k8s", submit={"kubernetes": {"api": "pytorchjob", "cloud": "eks"}})).body
    for spec in body["spec"]["pytorchReplicaSpecs"].values():
        assert problems("podtemplatespec-v1.json", spec["template"]) == []


def test_a_misspelled_pod_failure_rule_is_caught():
    [runtime] = kubernetes.build(make_job("k8s")).extra
    template = copy.deepcopy(runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"])
    rule = template["spec"]["podFailurePolicy"]["rules"][0]
    rule["onExitCode"] = rule.pop("onExitCodes")
    assert problems("jobtemplatespec-batch-v1.json", template) == [
        "/spec/podFailurePolicy/rules/0: Additional properties are not allowed ('onExitCode' was unexpected)"]

"""TrainJob, ClusterTrainingRuntime and PyTorchJob against the Kubeflow API models:
``kubeflow-trainer-api`` (generated from the Trainer CRDs' OpenAPI) for v2, and
``kubeflow-training``'s models with the ``kubernetes`` client's for v1. Both drop
unknown keys silently, as structural schemas allow them, so each manifest is also
walked for keys the models do not define."""

from __future__ import annotations

import typing

import pytest

from skylift.submit import kubernetes
from tests.submit.conftest import make_job


def pydantic_unknown_keys(model: type, value: typing.Any, path: str = "") -> list[str]:
    """Keys of ``value`` that ``model`` (a pydantic model of the trainer API) does not define."""
    if not isinstance(value, dict):
        return []
    fields = {(field.alias or name): field.annotation for name, field in model.model_fields.items()}
    problems = []
    for key, item in value.items():
        if key not in fields:
            problems.append(f"{path}.{key}")
            continue
        problems += _walk_annotation(fields[key], item, f"{path}.{key}")
    return problems


def _walk_annotation(annotation: typing.Any, value: typing.Any, path: str) -> list[str]:
    from pydantic import BaseModel

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, typing.Annotated) or str(origin) == "typing.Annotated":
        return [problem for arg in args if arg is not type(None) for problem in _walk_annotation(arg, value, path)]
    if origin is list and isinstance(value, list):
        return [problem for index, item in enumerate(value)
                for problem in _walk_annotation(args[0], item, f"{path}[{index}]")]
    if origin is dict and isinstance(value, dict):
        return [problem for key, item in value.items() for problem in _walk_annotation(args[1], item, f"{path}.{key}")]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return pydantic_unknown_keys(annotation, value, path)
    return []


def openapi_problems(type_name: str, value: typing.Any, path: str = "") -> list[str]:
    """Unknown keys and wrong primitive types against openapi-generator models (v1 + core)."""
    import re

    primitives = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in primitives:
        return [] if isinstance(value, primitives[type_name]) else [f"{path}: {value!r} is not {type_name}"]
    if match := re.fullmatch(r"list\[(.+)\]", type_name):
        return [problem for index, item in enumerate(value)
                for problem in openapi_problems(match[1], item, f"{path}[{index}]")]
    if match := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        return [problem for key, item in value.items() for problem in openapi_problems(match[1], item, f"{path}.{key}")]
    model = _openapi_model(type_name)
    json_names = {json_name: model.openapi_types[attribute] for attribute, json_name in model.attribute_map.items()}
    problems = []
    for key, item in value.items():
        if key not in json_names:
            problems.append(f"{path}.{key}: unknown")
        else:
            problems += openapi_problems(json_names[key], item, f"{path}.{key}")
    return problems


def _openapi_model(type_name: str):
    import kubeflow.training.models as training_models
    import kubernetes.client.models as core_models

    return getattr(training_models, type_name, None) or getattr(core_models, type_name)


def _manifests(**submit):
    request = kubernetes.build(make_job("k8s", submit=submit))
    return request, request.extra


@pytest.mark.parametrize("cloud", ["eks", "gke", "aks", "ack", "tke"])
def test_train_job_and_runtime_load_into_the_trainer_api_models(cloud):
    from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime, TrainerV1alpha1TrainJob

    request, [runtime] = _manifests(kubernetes={"cloud": cloud})
    train_job = TrainerV1alpha1TrainJob.from_dict(request.body)
    assert train_job.spec.runtime_ref.name == runtime["metadata"]["name"] == f"skylift-torch-spot-{cloud}"
    assert train_job.spec.trainer.num_nodes == 2
    assert train_job.spec.trainer.num_proc_per_node == 8
    cluster_runtime = TrainerV1alpha1ClusterTrainingRuntime.from_dict(runtime)
    policy = cluster_runtime.spec.template.spec.failure_policy
    assert policy.max_restarts == 10
    assert [rule.action for rule in policy.rules] == ["RestartJobSet", "FailJobSet"]
    assert pydantic_unknown_keys(TrainerV1alpha1TrainJob, request.body) == []
    assert pydantic_unknown_keys(TrainerV1alpha1ClusterTrainingRuntime, runtime) == []


def test_the_unknown_key_walk_catches_a_typo():
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    request, _ = _manifests()
    request.body["spec"]["trainer"]["numNode"] = 2
    assert pydantic_unknown_keys(TrainerV1alpha1TrainJob, request.body) == [".spec.trainer.numNode"]


def test_the_runtime_restarts_on_exit_143_and_on_node_disruption_with_the_notice_window():
    _, [runtime] = _manifests(kubernetes={"cloud": "gke"})
    job = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"]["values"] == [143]
    assert rules[1]["onPodConditions"][0]["type"] == "DisruptionTarget"
    pod = job["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 30  # GKE spot: 30 s notice
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert pod["tolerations"][0]["key"] == "cloud.google.com/gke-spot"
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it


def test_pytorch_job_v1_matches_the_training_operator_models():
    request = kubernetes.build(make_job("k8s", submit={"kubernetes": {"api": "pytorchjob", "cloud": "aks"}}))
    body = request.body
    assert (body["apiVersion"], body["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert openapi_problems("KubeflowOrgV1PyTorchJob", body) == []
    specs = body["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 1
    assert {spec["restartPolicy"] for spec in specs.values()} == {"ExitCode"}
    assert specs["Master"]["template"]["spec"]["containers"][0]["name"] == "pytorch"


def test_openapi_walk_catches_a_typo():
    body = kubernetes.build(make_job("k8s", submit={"kubernetes": {"api": "pytorchjob", "cloud": "eks"}})).body
    body["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicyy"] = "ExitCode"
    problems = openapi_problems("KubeflowOrgV1PyTorchJob", body)
    assert problems == [".spec.pytorchReplicaSpecs.Master.restartPolicyy: unknown"]


def test_spot_without_a_cluster_flavour_is_refused():
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match="submit.kubernetes.cloud"):
        kubernetes.build(make_job("k8s", submit={"kubernetes": {"cloud": "none"}}))


# Enumerations the models leave as plain strings, from the CRDs of kubeflow/trainer
# v2.3.0 (clustertrainingruntimes: failurePolicy) and v1.9.4 (pytorchjobs: restartPolicy),
# and the batch/v1 Job API (podFailurePolicy actions, Job failure reasons).
RESTART_STRATEGIES = {"Recreate", "BlockingRecreate", "InPlaceRestart"}
JOBSET_ACTIONS = {"FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts", "RestartJob",
                  "RestartJobAndIgnoreMaxRestarts"}
JOB_FAILURE_REASONS = {"BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                       "PodFailurePolicy"}
POD_FAILURE_ACTIONS = {"FailJob", "FailIndex", "Ignore", "Count"}
REPLICA_RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}


def test_the_manifests_use_only_values_the_apis_define():
    request, [runtime] = _manifests()
    jobset = runtime["spec"]["template"]["spec"]
    assert jobset["failurePolicy"]["restartStrategy"] in RESTART_STRATEGIES
    for rule in jobset["failurePolicy"]["rules"]:
        assert rule["action"] in JOBSET_ACTIONS
        assert set(rule["onJobFailureReasons"]) <= JOB_FAILURE_REASONS
    job = jobset["replicatedJobs"][0]["template"]["spec"]
    assert {rule["action"] for rule in job["podFailurePolicy"]["rules"]} <= POD_FAILURE_ACTIONS
    pytorch_job = kubernetes.build(make_job("k8s", submit={"kubernetes": {"api": "pytorchjob", "cloud": "eks"}})).body
    for spec in pytorch_job["spec"]["pytorchReplicaSpecs"].values():
        assert spec["restartPolicy"] in REPLICA_RESTART_POLICIES


def test_workers_save_inside_the_pods_grace_period():
    request, _ = _manifests(kubernetes={"cloud": "gke"})  # GKE spot: 30 s
    assert "preemption.grace_s=20" in request.body["spec"]["trainer"]["command"]
    request, _ = _manifests()  # EKS: 120 s
    assert "preemption.grace_s=110" in request.body["spec"]["trainer"]["command"]
    own = kubernetes.build(make_job("k8s", run=["preemption.grace_s=45"])).body
    assert not any(item.startswith("preemption.grace_s=1") for item in own["spec"]["trainer"]["command"])

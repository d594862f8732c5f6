"""Script jobs (``skylift submit --platform P -- python train.py ARGS``) on all five
platforms, validated as config jobs are: botocore's model and a moto server for
SageMaker, the vendors' SDK models for PAI-DLC and TI-ONE, the Kubeflow API models and
kubernetes-validate's schemas for Kubernetes, SkyPilot's schema (vendored here; its own
code in ``make test-skypilot``)."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml

from skylift.submit import kubernetes, pai, sagemaker, skypilot, tione
from tests.submit.script_jobs import launch_argv, make_script_job, root_for
from tests.submit.test_kubernetes import openapi_problems, pydantic_unknown_keys
from tests.submit.test_kubernetes_schemas import problems as kubernetes_problems
from tests.submit.test_sagemaker import _client, _input_shape, model_problems
from tests.submit.test_skypilot import _validate as validate_skypilot_task
from tests.submit.test_tione import _load_strictly


@pytest.mark.parametrize("instances", [1, 2])
def test_sagemaker_runs_skylift_launch_on_the_script_within_the_service_model(instances):
    body = sagemaker.build(make_script_job("sagemaker", submit={"instance_count": instances})).body
    assert model_problems(_input_shape(), body) == []
    spec = body["AlgorithmSpecification"]
    # One instance: SageMaker's synced folder; several: the S3 root every rank commits to.
    root = sagemaker.CHECKPOINT_LOCAL_PATH if instances == 1 else root_for("sagemaker")
    # The run folder is SageMaker's model directory, which it uploads when the job ends.
    assert spec["ContainerEntrypoint"] + spec["ContainerArguments"] == launch_argv(root, run_dir="/opt/ml/model")
    assert ("CheckpointConfig" in body) is (instances == 1)
    assert "InputDataConfig" not in body  # a script reads its own data
    assert body["TrainingJobName"].startswith("skylift-own-loop-")


def test_moto_accepts_the_script_job(moto_server, vendor_credentials):
    request = sagemaker.build(make_script_job("sagemaker", submit={"instance_count": 1}))
    client = _client(moto_server.endpoint_url)
    client.create_training_job(**request.body)  # botocore validates the parameters first
    job = client.describe_training_job(TrainingJobName=request.body["TrainingJobName"])
    assert job["AlgorithmSpecification"]["ContainerArguments"] == launch_argv(sagemaker.CHECKPOINT_LOCAL_PATH, run_dir="/opt/ml/model")[1:]
    assert job["CheckpointConfig"]["S3Uri"] == root_for("sagemaker") + "/"


def test_pai_mounts_the_checkpoint_root_and_gives_the_script_the_save_window():
    from alibabacloud_pai_dlc20201203 import models

    body = pai.build(make_script_job("pai")).body
    mapped = models.CreateJobRequest().from_map(body).to_map()
    for key in body.keys() - {"JobSpecs"}:
        assert mapped[key] == body[key], key
    grace_s = f"{pai.RECLAIM_GRACE_S - 10}"  # ten seconds of the release window stay for torchrun to stop
    assert shlex.split(body["UserCommand"]) == launch_argv(pai.CHECKPOINT_MOUNT, grace_s=grace_s)
    assert [source["MountPath"] for source in body["DataSources"]] == [pai.CHECKPOINT_MOUNT]


def test_tione_loads_strictly_into_the_sdk_model():
    body = tione.build(make_script_job("tione")).body
    request = _load_strictly(body)
    assert shlex.split(request.StartCmdInfo.StartCmd) == launch_argv(root_for("tione"))
    assert "DataConfigs" not in body
    assert {env["Name"] for env in body["Envs"]} == {"SKYLIFT_PLATFORM", "SKYLIFT_COS_ENDPOINT_URL"}


def test_the_train_job_loads_into_the_trainer_models_and_its_parts_match_kubernetes():
    from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime, TrainerV1alpha1TrainJob

    request = kubernetes.build(make_script_job("k8s"))
    [runtime] = request.extra
    assert pydantic_unknown_keys(TrainerV1alpha1TrainJob, request.body) == []
    assert pydantic_unknown_keys(TrainerV1alpha1ClusterTrainingRuntime, runtime) == []
    trainer = TrainerV1alpha1TrainJob.from_dict(request.body).spec.trainer
    grace_s = f"{kubernetes.grace_period_s(make_script_job('k8s').options) - 10}"
    assert trainer.command == launch_argv(root_for("k8s"), grace_s=grace_s)
    for env in request.body["spec"]["trainer"]["env"]:
        assert kubernetes_problems("envvar-v1.json", env) == []
    resources = request.body["spec"]["trainer"]["resourcesPerNode"]
    assert kubernetes_problems("resourcerequirements-v1.json", resources) == []


def test_the_pytorch_job_matches_the_training_operator_and_kubernetes():
    body = kubernetes.build(make_script_job("k8s", submit={"kubernetes": {"api": "pytorchjob", "cloud": "eks"}})).body
    assert openapi_problems("KubeflowOrgV1PyTorchJob", body) == []
    for spec in body["spec"]["pytorchReplicaSpecs"].values():
        assert kubernetes_problems("podtemplatespec-v1.json", spec["template"]) == []
        assert spec["template"]["spec"]["containers"][0]["command"][:2] == ["skylift", "launch"]


def test_the_skypilot_task_matches_the_schema():
    task = yaml.safe_load(skypilot.task_yaml(skypilot.build(make_script_job("skypilot"))))
    validate_skypilot_task(task)
    assert shlex.split(task["run"]) == launch_argv(root_for("skypilot"))
    assert task["resources"]["job_recovery"]["recover_on_exit_codes"] == [143]


def test_the_torch_free_script_job_of_make_test_skypilot_is_the_one_submit_builds():
    from tests.submit.skypilot_jobs import torch_free_script_job

    assert skypilot.build(torch_free_script_job()).body == skypilot.build(make_script_job("skypilot")).body


def test_a_config_grace_period_reaches_launch_and_the_platform_window_does_not_replace_it():
    body = pai.build(make_script_job("pai", run=["preemption.grace_s=45"])).body
    assert shlex.split(body["UserCommand"]) == launch_argv(pai.CHECKPOINT_MOUNT, grace_s="45")


def test_without_a_config_the_run_folder_is_the_scripts_own_and_the_job_is_named_after_it():
    job = make_script_job("skypilot", config=None)
    task = skypilot.build(job).body
    assert shlex.split(task["run"]) == launch_argv(root_for("skypilot"), run_dir=None)
    assert task["name"].startswith("skylift-own-loop-")
    named = make_script_job("skypilot", config=None, run=["run_dir=runs/mine"])
    assert "--run-dir runs/mine" in skypilot.build(named).body["run"]


def test_a_module_script_is_run_with_python_dash_m():
    job = make_script_job("k8s", config=None, script=("python", "-m", "trl.scripts.sft", "--max_new_tokens", "64"))
    command = kubernetes.build(job).body["spec"]["trainer"]["command"]
    assert command[command.index("--"):] == ["--", "python", "-m", "trl.scripts.sft", "--max_new_tokens", "64"]
    assert job.name.startswith("skylift-sft-")


def test_the_request_document_of_a_script_job_is_json_and_names_no_data():
    from skylift.submit.output import request_document

    document = request_document(sagemaker.build(make_script_job("sagemaker")))
    assert json.loads(json.dumps(document)) == document
    assert "data" not in json.dumps(document["request"]["AlgorithmSpecification"])

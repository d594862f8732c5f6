"""SageMaker CreateTrainingJob: botocore's own validation, a loopback moto server, and
the enums, patterns and maxima of the same service model (which botocore skips)."""

from __future__ import annotations

import re

import pytest

from skylift.submit import sagemaker
from tests.submit.conftest import make_job


def _client(endpoint_url: str):
    import boto3
    from botocore.config import Config

    # moto does not implement StopTrainingJob; one attempt keeps a 500 from being retried.
    return boto3.client("sagemaker", region_name="us-east-1", endpoint_url=endpoint_url,
                        config=Config(retries={"max_attempts": 1}))


def model_problems(shape, value, path: str = "") -> list[str]:
    """What botocore's validator does not check: enum, pattern, max length/value/items."""
    problems = []
    kind = shape.type_name
    if kind == "structure":
        for name, item in value.items():
            problems += model_problems(shape.members[name], item, f"{path}.{name}")
    elif kind == "list":
        if len(value) > shape.metadata.get("max", len(value)):
            problems.append(f"{path}: {len(value)} items > max {shape.metadata['max']}")
        for index, item in enumerate(value):
            problems += model_problems(shape.member, item, f"{path}[{index}]")
    elif kind == "map":
        if len(value) > shape.metadata.get("max", len(value)):
            problems.append(f"{path}: {len(value)} entries > max {shape.metadata['max']}")
        for key, item in value.items():
            problems += model_problems(shape.key, key, f"{path} key {key!r}")
            problems += model_problems(shape.value, item, f"{path}[{key!r}]")
    elif kind == "string":
        if shape.enum and value not in shape.enum:
            problems.append(f"{path}: {value!r} not in the model's enum")
        pattern = _python_pattern(shape.metadata.get("pattern"))
        if pattern and not re.fullmatch(pattern, value, re.DOTALL):
            problems.append(f"{path}: {value!r} does not match {pattern}")
        if len(value) > shape.metadata.get("max", len(value)):
            problems.append(f"{path}: longer than {shape.metadata['max']}")
    elif kind in ("integer", "long") and value > shape.metadata.get("max", value):
        problems.append(f"{path}: {value} > max {shape.metadata['max']}")
    return problems


# The model's patterns are Java regexes; these classes are the ones it uses, narrowed to
# ASCII (our values are ASCII).
_JAVA_CLASSES = {r"\p{Alnum}": "a-zA-Z0-9", r"\p{L}": "a-zA-Z", r"\p{Z}": " ", r"\p{N}": "0-9"}


def _python_pattern(pattern: str | None) -> str | None:
    if not pattern:
        return None
    for java, python in _JAVA_CLASSES.items():
        pattern = pattern.replace(java, python)
    return pattern.removeprefix("^").removesuffix("$")


def _input_shape():
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    return model.operation_model("CreateTrainingJob").input_shape


@pytest.mark.parametrize("spot", [True, False])
def test_request_passes_the_service_models_enums_patterns_and_maxima(spot):
    request = sagemaker.build(make_job("sagemaker", submit={"spot": spot}))
    assert model_problems(_input_shape(), request.body) == []
    condition = request.body["StoppingCondition"]
    assert request.body["EnableManagedSpotTraining"] is spot
    if spot:
        assert condition["MaxWaitTimeInSeconds"] >= condition["MaxRuntimeInSeconds"]
    else:
        assert "MaxWaitTimeInSeconds" not in condition


def test_the_model_walker_catches_what_botocore_lets_through():
    body = sagemaker.build(make_job("sagemaker")).body
    body = {**body, "TrainingJobName": "bad name!",
            "ResourceConfig": {**body["ResourceConfig"], "InstanceType": "ml.p99.huge"}}
    problems = model_problems(_input_shape(), body)
    assert any("TrainingJobName" in problem for problem in problems)
    assert any("ml.p99.huge" in problem for problem in problems)


def test_moto_accepts_the_request_and_describe_returns_it(moto_server, vendor_credentials):
    request = sagemaker.build(make_job("sagemaker", submit={"instance_count": 1}))
    client = _client(moto_server.endpoint_url)
    client.create_training_job(**request.body)  # botocore validates the parameters first
    job = client.describe_training_job(TrainingJobName=request.body["TrainingJobName"])
    assert job["AlgorithmSpecification"]["TrainingImage"] == request.body["AlgorithmSpecification"]["TrainingImage"]
    assert job["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert job["ResourceConfig"]["InstanceCount"] == 1
    assert job["EnableManagedSpotTraining"] is True
    assert job["CheckpointConfig"] == {"S3Uri": "s3://bucket-1250000000/runs/quick/",
                                       "LocalPath": "/opt/ml/checkpoints"}
    assert job["StoppingCondition"]["MaxWaitTimeInSeconds"] >= job["StoppingCondition"]["MaxRuntimeInSeconds"]


def test_botocore_rejects_an_unknown_parameter(moto_server, vendor_credentials):
    from botocore.exceptions import ParamValidationError

    body = {**sagemaker.build(make_job("sagemaker")).body, "EnableSpot": True}
    with pytest.raises(ParamValidationError):
        _client(moto_server.endpoint_url).create_training_job(**body)


def test_one_instance_checkpoints_where_sagemaker_syncs_and_reads_the_mounted_channels():
    body = sagemaker.build(make_job("sagemaker", submit={"instance_count": 1})).body
    arguments = body["AlgorithmSpecification"]["ContainerArguments"]
    assert body["AlgorithmSpecification"]["ContainerEntrypoint"] == ["skylift"]
    assert arguments[:4] == ["run", "examples/quickstart.yaml", "--resume", "auto"]
    assert "checkpoint.root=/opt/ml/checkpoints" in arguments
    # The run folder where SageMaker uploads it at the end (the request replaces the image's
    # entry point, which would have put it there).
    assert arguments[arguments.index("run_dir=/opt/ml/model") - 1] == "--set"
    assert body["CheckpointConfig"] == {"S3Uri": "s3://bucket-1250000000/runs/quick/",
                                        "LocalPath": "/opt/ml/checkpoints"}
    assert "data.url=/opt/ml/input/data/train" in arguments
    assert "data.val_url=/opt/ml/input/data/validation" in arguments
    channels = {channel["ChannelName"]: channel for channel in body["InputDataConfig"]}
    assert channels["train"]["DataSource"]["S3DataSource"]["S3Uri"] == "s3://bucket-1250000000/shards/train"


def test_several_instances_share_the_s3_root_the_ranks_commit_to():
    body = sagemaker.build(make_job("sagemaker", submit={"instance_count": 2})).body
    assert "CheckpointConfig" not in body  # per-instance sync cannot hold one shared step-N/
    assert "checkpoint.root=s3://bucket-1250000000/runs/quick" in body["AlgorithmSpecification"]["ContainerArguments"]


def test_max_wait_below_max_runtime_is_refused():
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match="max_wait_s"):
        make_job("sagemaker", submit={"max_runtime_s": 7200, "max_wait_s": 3600})


def test_a_checkpoint_root_off_s3_is_refused_with_the_fix():
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match=r"s3://BUCKET/PREFIX"):
        sagemaker.build(make_job("pai"))
